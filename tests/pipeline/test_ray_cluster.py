"""A real Ray cluster: ``ray start --head`` on 127.0.0.1, a sweep driven against its address.

The driver runs in a subprocess: a process connects to one Ray cluster only, and this test
session may already hold the local ``ray_local`` cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.ray_runtime import loopback_env
from pipeline.tracking import PARENT_TAG, connect
from sat_model.config import load_params

RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[str]:
    """``ray start --head --block`` as a child process; terminated (with its raylet) after."""
    port = _free_port()
    temp_dir = Path("/tmp") / f"rayc{port}"  # short: Ray's socket paths have a length limit
    env = loopback_env()
    head = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "ray_head.log").open("w"),
        start_new_session=True,  # its own process group: GCS, raylet and workers, no one else's
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the GCS port answers once the head is up
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, (tmp_path / "ray_head.log").read_text()
            time.sleep(1)
        else:
            pytest.fail("ray start --head did not come up in 120 s")
        yield address
    finally:
        # only the processes this test started: `ray stop` would end every Ray on the machine
        _stop_group(head)
        strays = _processes_mentioning(str(temp_dir))
        for pid in strays:  # ours for sure: our private session folder is in their command
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_group(head: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group, SIGKILL what is left after 5 s, check it is gone.

    ``ray start --block`` under load can take tens of seconds to wind down on SIGTERM; the group
    holds only this test's head (GCS, raylet, workers), so killing it outright loses nothing.
    """
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(head.pid):
            head.poll()  # reap the leader so its group can empty
            time.sleep(0.5)
        if not _group_alive(head.pid):
            break
    head.wait(timeout=10)
    assert not _group_alive(head.pid), f"ray head process group {head.pid} still running"


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_text(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return pids


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.java
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_sweep_runs_against_a_started_cluster(
    ray_head: str, tiny_project: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(tiny_project, project, ignore=shutil.ignore_patterns("mlflow.db", "reports"))
    env = loopback_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)  # the --address flag is what is tested
    env["RAY_AUTH_MODE"] = "token"  # `ray start` turned token auth on (~/.ray/auth_token)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.stages.tune",
            "--params",
            str(project / "params.yaml"),
            "-S",
            "tune.num_samples=2",
            "-S",
            "tune.max_epochs=1",
            "--address",
            ray_head,
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    best = yaml.safe_load((project / "reports" / "tune" / "best_params.yaml").read_text())
    assert set(best["params"]) == {"train.soft.lr", "train.soft.doubly_stochastic"}
    assert f"{best['score']:.4f}" in out.stdout
    params = load_params(project / "params.yaml")
    tracking = connect(params.mlflow, project)
    client = tracking.client()
    (parent,) = client.search_runs([tracking.experiment_id], "tags.`sat.sweep` = '1'")
    children = client.search_runs(
        [tracking.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    )
    assert len(children) == 2
    for child in children:  # one epoch each, on the cluster's workers
        history = client.get_metric_history(child.info.run_id, "val_bleu_4")
        assert [m.step for m in history] == [1]
