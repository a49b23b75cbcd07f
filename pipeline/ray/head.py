"""One local Ray head for a whole command: ``python -m pipeline.ray.head [--params F] -- CMD ...``.

``make run`` wraps ``dvc repro`` in this, so both train stages connect to one cluster
(``RAY_ADDRESS=127.0.0.1:<port>``) instead of each starting and stopping its own
(decisions/010). The head is ``ray start --head --block`` on loopback in its own process group,
with token authentication (a missing token is created first: ``ray start`` would otherwise run
without one and refuse the stages' drivers), stopped by that group's id when the command ends,
fails or is interrupted, never with ``ray stop`` (which would stop every Ray on the machine); a
watchdog (:mod:`pipeline.ray.reaper`) does the same if this process is killed. With an address
already given (``RAY_ADDRESS`` or ``ray.address``) nothing is started.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from pipeline.ray.reaper import start_reaper, stop_group
from pipeline.ray.runtime import loopback_env, resolve_address
from pipeline.settings import Params, load_params
from sat_model.config import ParamsError

__all__ = ["RayHeadError", "main", "ray_head", "run_with_head"]

_START_TIMEOUT_S = 120.0
# SIGTERM first, SIGKILL what is left after this long: after a Ray Train run the raylet and GCS
# linger on Train's leftover actors (decisions/010), and the head's state is private to
# this command (its own temp dir, removed below), so nothing is lost by killing it.
_TERM_GRACE_S = 2.0


class RayHeadError(RuntimeError):
    """The head did not come up (the message carries the end of its log)."""


_PORT_FLAGS = (
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL what is left after a grace period."""
    stop_group(proc.pid, _TERM_GRACE_S, reap=proc)
    proc.wait(timeout=10)


def _ray_cli() -> str:
    ray = Path(sys.executable).with_name("ray")
    return str(ray if ray.exists() else "ray")


def _token_file(env: Mapping[str, str]) -> Path:
    """Where Ray looks for the token when ``RAY_AUTH_TOKEN`` is not set (its own order)."""
    given = env.get("RAY_AUTH_TOKEN_PATH")
    return (
        Path(given).expanduser()
        if given
        else Path(env.get("HOME", "~")).expanduser() / ".ray/auth_token"
    )


def _ensure_auth_token(env: Mapping[str, str]) -> None:
    """Create Ray's authentication token when none exists (module docstring)."""
    token_file = _token_file(env)
    if env.get("RAY_AUTH_TOKEN") or token_file.is_file():
        return
    result = subprocess.run(
        [_ray_cli(), "get-auth-token", "--generate"],
        env=dict(env),
        stdout=subprocess.DEVNULL,  # the token itself: never printed
        stderr=subprocess.PIPE,
        text=True,
    )
    if result.returncode != 0 or not token_file.is_file():
        raise RayHeadError(
            f"could not create a Ray authentication token at {token_file}: "
            f"{result.stderr.strip()[-500:]}"
        )
    token_file.chmod(0o600)
    print(f"ray_head: created Ray's authentication token, {token_file} (owner only)", flush=True)


def _wait_until_up(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _port_open(port):  # the GCS port answers once the head is up
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RayHeadError(f"ray start --head did not come up on 127.0.0.1:{port}:\n{tail}")
        time.sleep(0.2)


@contextmanager
def ray_head(num_cpus: int, temp_root: Path | None = None) -> Iterator[str]:
    """Start a loopback Ray head for the block; yields its ``host:port`` address."""
    port = _free_port()
    # short: Ray's socket paths inside the temp dir have a length limit of ~107 bytes
    temp_dir = (temp_root or Path("/tmp")) / f"sat-ray-{port}"
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir / "head.log"
    env = {**loopback_env(), "RAY_AUTH_MODE": "token"}
    _ensure_auth_token(env)
    cmd = [
        _ray_cli(),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        # Ray's fixed defaults (client server 10001, agents 52365...) would be shared by two
        # heads on one machine, two `make run`s say: each gets free ports of its own
        *(f"--{flag}={_free_port()}" for flag in _PORT_FLAGS),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    reaper = start_reaper(proc.pid, [temp_dir])  # cleans up if this process is SIGKILLed
    try:
        _wait_until_up(proc, port, log)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
        reaper.terminate()
        reaper.wait()


def _raise_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through ray_head's finally: the head is stopped


def run_with_head(command: Sequence[str], num_cpus: int, address: str | None) -> int:
    """Run ``command`` against ``address``, or against a head started for it; its exit code."""
    env = loopback_env()
    if address:
        return subprocess.run(list(command), env=env).returncode
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    started = time.perf_counter()
    with ray_head(num_cpus) as head:
        print(f"ray_head: Ray head on {head} ({time.perf_counter() - started:.1f} s)", flush=True)
        env.update(RAY_ADDRESS=head, RAY_AUTH_MODE="token")  # as the head runs
        code = subprocess.run(list(command), env=env).returncode
        stopping = time.perf_counter()
    print(f"ray_head: Ray head stopped ({time.perf_counter() - stopping:.1f} s)", flush=True)
    return code


def _dataset_missing(params: Params, project: Path) -> str:
    """Why prepare would stop at once, for a project never prepared (the dataset is not in
    place), so that no cluster is started for it; ``""`` otherwise. Prepared data already there
    (``dvc pull``) needs no dataset."""
    from sat_model.data.sources import dataset_missing

    if (project / params.data.prepared_dir).is_dir():
        return ""
    return dataset_missing(params.data, project)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.ray.head", description=__doc__)
    parser.add_argument("--params", default="params.yaml", help="params file (%(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (python -m pipeline.ray.head -- dvc repro)")
    try:
        params = load_params(args.params)
    except ParamsError as e:  # a typo, or `make run PROFILE=<name>` with no profiles/<name>/
        print(f"ray_head: {e}", file=sys.stderr)
        return 1
    if missing := _dataset_missing(params, Path(args.params).resolve().parent):
        print(f"ray_head: {missing}", file=sys.stderr)
        return 1
    cfg = params.ray
    try:
        return run_with_head(command, cfg.num_cpus, resolve_address(cfg))
    except RayHeadError as e:
        print(f"ray_head: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
