"""``python -m pipeline.ray.head -- CMD``: one loopback Ray head per command, stopped by PID.

Three heads: one command that connects and fails, which the tests of a whole command share, and
one whose wrapper is killed, with a second head beside it while it runs.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.ray.runtime import loopback_env

_WRAPPER = (sys.executable, "-m", "pipeline.ray.head")

# The command connects, runs a task, records the address it was given, then fails.
_FAILING_STAGE = """
import os, sys, ray
ray.init()  # RAY_ADDRESS and RAY_AUTH_MODE=token from the wrapper: connects, starts nothing
assert ray.cluster_resources()["CPU"] == 1  # the params' num_cpus
print("answer", ray.get(ray.remote(lambda: 41 + 1).remote()))
open(sys.argv[1], "w").write(os.environ["RAY_ADDRESS"])
sys.exit(3)
"""


@dataclass(frozen=True)
class FailedStage:
    out: subprocess.CompletedProcess[str]  # the wrapper's
    address: str  # the one the stage was given
    home: Path


@pytest.fixture(scope="module")
def failed_stage(tmp_path_factory: pytest.TempPathFactory) -> FailedStage:
    """One head for the tests of a whole command: the wrapper run on a machine that never ran
    Ray (an empty HOME: no ~/.ray/auth_token) around a stage that connects and then fails."""
    tmp = tmp_path_factory.mktemp("head")
    params, seen, home = tmp / "params.yaml", tmp / "address", tmp / "home"
    params.write_text("ray:\n  num_cpus: 1\n")
    home.mkdir()
    env = {**loopback_env(), "HOME": str(home)}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    command = [*_WRAPPER, "--params", str(params), "--"]
    out = subprocess.run(
        [*command, sys.executable, "-c", _FAILING_STAGE, str(seen)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return FailedStage(out, seen.read_text() if seen.is_file() else "", home)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.ray
@pytest.mark.slow
def test_head_is_stopped_when_the_command_fails(failed_stage: FailedStage) -> None:
    out = failed_stage.out
    assert out.returncode == 3, out.stderr[-2000:]  # the command's own exit code
    host, port = failed_stage.address.split(":")
    assert host == "127.0.0.1"
    assert not _listening(int(port))  # the head is gone
    assert not Path(f"/tmp/sat-ray-{port}").exists()  # and its private temp dir
    assert "Ray head stopped" in out.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_a_machine_that_never_ran_ray_gets_a_token_and_the_stages_connect(
    failed_stage: FailedStage,
) -> None:
    # a fresh machine: no ~/.ray/auth_token. `ray start` would then start the head without
    # authentication and a driver with RAY_AUTH_MODE=token would be refused (a fresh clone's
    # first `make run` failed at its first train stage so)
    out = failed_stage.out
    assert "answer 42" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    token = failed_stage.home / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert token.read_text().strip() not in out.stdout + out.stderr  # never printed


def test_a_given_address_starts_no_head(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("ray:\n  address: 127.0.0.1:1\n")
    env = {**loopback_env(), "RAY_ADDRESS": ""}
    code = "import os, sys; sys.exit(0 if 'RAY_AUTH_MODE' not in os.environ else 5)"
    env.pop("RAY_AUTH_MODE", None)
    out = subprocess.run(
        [*_WRAPPER, "--params", str(params), "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ray head" not in out.stdout


_ANSWER = "import ray; ray.init(); print(ray.get(ray.remote(lambda: 42).remote()))"


def _client_server_port(address: str) -> int | None:
    """The port of the Ray client server that serves the head at ``address``, if one runs."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "ray.util.client.server" in cmd and f"--address={address}" in cmd:
            return int(next(a for a in cmd if a.startswith("--port=")).split("=", 1)[1])
    return None


def _answer_on_two_heads(address: str) -> None:
    """A task answers on the head at ``address`` and on a second one started meanwhile, each
    with a client server of its own."""
    from pipeline.ray.head import ray_head

    env = loopback_env()
    env.pop("RAY_ADDRESS", None)
    with ray_head(1) as second:  # each in /tmp/sat-ray-<its port>
        for head in (address, second):
            out = subprocess.run(
                [sys.executable, "-c", _ANSWER],
                env={**env, "RAY_ADDRESS": head, "RAY_AUTH_MODE": "token"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.stdout.split()[-1:] == ["42"], out.stderr[-2000:]
        ports = [_client_server_port(a) for a in (address, second)]
    assert None not in ports and len(set(ports)) == 2 and 10001 not in ports, ports


@pytest.mark.ray
@pytest.mark.slow
def test_two_heads_run_at_once_and_a_sigkilled_wrapper_leaves_no_head_and_no_temp_dir(
    tmp_path: Path,
) -> None:
    """Two `make run`s: each head has ports of its own, none of Ray's fixed defaults (the
    client server's 10001 was asked for by both heads). Then the first `make run`'s wrapper,
    killed with SIGKILL, runs no finally: its watchdog stops its head."""
    import os
    import signal
    import time

    import psutil

    params = tmp_path / "params.yaml"
    params.write_text("ray:\n  num_cpus: 1\n")
    seen = tmp_path / "address"
    stage = "import os, sys, time; open(sys.argv[1], 'w').write(os.environ['RAY_ADDRESS']); "
    stage += "time.sleep(600)"
    env = loopback_env()
    env.pop("RAY_ADDRESS", None)
    wrapper = subprocess.Popen(
        [*_WRAPPER, "--params", str(params), "--", sys.executable, "-c", stage, str(seen)],
        env=env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not seen.exists() or not seen.read_text():
            assert wrapper.poll() is None and time.monotonic() < deadline, "no head came up"
            time.sleep(0.5)
        port = int(seen.read_text().split(":")[1])
        head = [
            p
            for p in psutil.process_iter(["cmdline"])
            if f"--port={port}" in " ".join(p.info["cmdline"] or [])
        ]
        assert head and _listening(port)
        _answer_on_two_heads(seen.read_text())
        wrapper.send_signal(signal.SIGKILL)
        wrapper.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            _listening(port) or Path(f"/tmp/sat-ray-{port}").exists()
        ):
            time.sleep(0.5)
        assert not _listening(port)
        assert not Path(f"/tmp/sat-ray-{port}").exists()
        assert not [p for p in head if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        os.killpg(wrapper.pid, signal.SIGKILL)  # the stage (sleep) is the test's to end
