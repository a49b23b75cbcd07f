"""A real multi-node Ray cluster for tests: :func:`ray_nodes` starts several ``ray start --block``
nodes on 127.0.0.1 (a head, optionally with the dashboard that serves Ray Jobs, and named nodes
with a resource of their own), each in its own process group, stopped by its own PID afterwards
(never by name: other test runs on the machine may run Ray too)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.pipeline.servers import free_port, stop_process_group, wait_for_port

__all__ = ["RayNodes", "ray_nodes"]


def _group_pids(pgid: int) -> list[tuple[int, str]]:
    """(pid, NUL-separated command line) of every process in the group ``pgid``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.getpgid(int(proc.name)) == pgid:
                found.append((int(proc.name), (proc / "cmdline").read_text(errors="replace")))
        except (OSError, ProcessLookupError):
            continue
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop what is left of a node's process group, SIGKILL the rest, check it is gone."""
    stop_process_group(proc, timeout_s=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while _group_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_pids(proc.pid), f"ray node group {proc.pid} still running"


class RayNodes:
    """Ray nodes on 127.0.0.1 (head plus named nodes), each ``ray start --block`` in its own
    process group, with its own CPUs and a custom resource named after it (``head``, ...) that
    a task can ask for to land on it. Ports are free ones; logs go to ``tmp/<node>.log``.

    A joining node gives the head as ``127.1``: 127.0.0.1 to the resolver, while Ray would
    rewrite "127.0.0.1" to the machine's address when a node joins a cluster (which needs
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``; the explicit ``--node-ip-address`` keeps the node
    on loopback all the same; gRPC's own resolver does not read "127.1", the system's does).
    Each node has a temp dir of its own, as on separate machines: nodes sharing one would
    share its runtime environments (a node's clean-up deleted the ``working_dir`` a Ray Job's
    driver ran in on the head) and its ``ray_current_cluster`` file (``address="auto"``).
    """

    def __init__(self, tmp: Path, env: dict[str, str], *, dashboard: bool = False) -> None:
        self.tmp, self.env, self.port = tmp, env, free_port()
        self.dashboard_port = free_port() if dashboard else None
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """Where Ray Jobs are submitted (``sat ... --address``)."""
        assert self.dashboard_port is not None, "started without the dashboard"
        return f"http://127.0.0.1:{self.dashboard_port}"

    def temp_dir(self, name: str) -> Path:
        return Path("/tmp") / f"raymn{self.port}{name}"  # short: socket path length limit

    def _cmd(self, name: str, num_cpus: int, extra: list[str]) -> list[str]:
        ports = [
            "--dashboard-agent-listen-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
        ]
        cmd = [str(Path(sys.executable).with_name("ray")), "start", "--block"]
        cmd += ["--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}"]
        cmd += [f"--resources={json.dumps({name: 1})}", f"--temp-dir={self.temp_dir(name)}"]
        return cmd + [f"{flag}={free_port()}" for flag in ports] + extra

    def start_head(self, num_cpus: int = 1) -> None:
        extra = ["--head", f"--port={self.port}"]
        extra += [f"--ray-client-server-port={free_port()}"]
        if self.dashboard_port is None:
            extra += ["--include-dashboard=false"]
        else:
            extra += ["--include-dashboard=true", "--dashboard-host=127.0.0.1"]
            extra += [f"--dashboard-port={self.dashboard_port}"]
        self.commands["head"] = self._cmd("head", num_cpus, extra)
        self._launch("head", self.env)
        # its GCS port first (a socket, not a Python probe that imports Ray each time)
        wait_for_port(self.port, self.procs["head"], "ray start --head", 120)
        self._wait_for_nodes(1)
        if self.dashboard_port is not None:
            self._wait_for_dashboard()

    def add_node(self, name: str, num_cpus: int = 1) -> None:
        self.commands[name] = self._cmd(name, num_cpus, [f"--address=127.1:{self.port}"])
        self.restart(name)

    def restart(self, name: str) -> None:
        """Start node ``name`` (again: the same ``ray start --address`` command)."""
        env = {**self.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "GRPC_DNS_RESOLVER": "native"}
        self._launch(name, env)
        self._wait_for_nodes(sum(p.poll() is None for p in self.procs.values()))

    def _launch(self, name: str, env: dict[str, str]) -> None:
        log = (self.tmp / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            self.commands[name],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        log.close()

    def kill_raylet(self, name: str) -> int:
        """SIGKILL node ``name``'s raylet, then what is left of its group; the raylet's pid."""
        proc = self.procs[name]
        (raylet,) = [p for p, cmd in _group_pids(proc.pid) if "raylet" in cmd.split("\0")[0]]
        os.kill(raylet, signal.SIGKILL)
        _kill_group(proc)  # `ray start --block` and its agents go with their raylet
        return raylet

    def _wait_for_nodes(self, n: int) -> None:
        code = (
            f"import ray; ray.init(address={self.address!r}, logging_level='ERROR');"
            "print(sum(1 for x in ray.nodes() if x['Alive']))"
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = subprocess.run(
                [sys.executable, "-c", code], env=self.env, capture_output=True, text=True
            )
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(2)
        logs = "".join(p.read_text() for p in sorted(self.tmp.glob("*.log")))
        pytest.fail(f"{n} Ray node(s) did not come up: {logs[-3000:]}")

    def _wait_for_dashboard(self) -> None:
        """Until the dashboard answers HTTP (401 without a token counts: it is up)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(1)
        pytest.fail(f"the Ray dashboard did not answer at {self.dashboard_url} in 120 s")

    def stop(self) -> None:
        for name, proc in self.procs.items():
            _kill_group(proc)
            shutil.rmtree(self.temp_dir(name), ignore_errors=True)


@contextmanager
def ray_nodes(
    tmp: Path,
    env: dict[str, str],
    nodes: dict[str, int],
    *,
    head_cpus: int = 1,
    dashboard: bool = False,
) -> Iterator[RayNodes]:
    """A head with ``head_cpus`` CPUs and a node per ``nodes`` item (name -> CPUs), all stopped
    by their own process groups afterwards. ``env`` is every node's environment (Ray's
    loopback settings, credentials the workers need, ``PATH`` whose ``python`` jobs run)."""
    cluster = RayNodes(tmp, env, dashboard=dashboard)
    try:
        cluster.start_head(head_cpus)
        for name, cpus in nodes.items():
            cluster.add_node(name, cpus)
        yield cluster
    finally:
        cluster.stop()
