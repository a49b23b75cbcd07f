"""``sat tune --address http://head:8265``: the sweep submitted to a real Ray head as a Ray Job.

A real ``ray start --head`` with its dashboard (which serves Ray Jobs) and a real ``mlflow
server`` on 127.0.0.1; ``sat`` runs as a subprocess exactly as the README's "Scaling out" shows,
with the tracking server in ``MLFLOW_TRACKING_URI`` and token authentication on the client
(``RAY_AUTH_MODE=token``). Every process is stopped by its own process group afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.ray_runtime import loopback_env
from tests.pipeline.servers import free_port, mlflow_server, stop_process_group

pytestmark = [pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _wait_for_dashboard(url: str, head: subprocess.Popen[bytes], log: Path) -> None:
    """Until the dashboard answers HTTP (401 without a token counts: it is up)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert head.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the Ray dashboard did not answer at {url} in 120 s")


@pytest.fixture(scope="module")
def ray_head_with_dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ray start --head --block`` with the dashboard on a free port; yields its URL."""
    port, dashboard = free_port(), free_port()
    temp_dir = Path("/tmp") / f"rayj{port}"  # short: Ray's socket paths have a length limit
    log = tmp_path_factory.mktemp("ray_head") / "ray_head.log"
    env = loopback_env()
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the job's `python` is this one
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,  # its own process group: GCS, raylet, dashboard, job drivers
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_dashboard(url, head, log)
        yield url
    finally:
        stop_process_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mlflow_server")
    with mlflow_server(tmp, f"sqlite:///{tmp / 'mlflow.db'}", str(tmp / "artifacts")) as uri:
        yield uri


def _sat(args: list[str], tracking_uri: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = loopback_env()
    env.pop("RAY_ADDRESS", None)  # the --address flag is what is tested
    env.update(MLFLOW_TRACKING_URI=tracking_uri, RAY_AUTH_MODE="token")
    return subprocess.run(
        [str(BIN / "sat"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=500,
    )


@pytest.mark.java
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_sat_tune_submitted_as_a_ray_job_streams_its_log_and_logs_its_trials(
    ray_head_with_dashboard: str, tracking_server: str, tiny_project: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(tiny_project, project, ignore=shutil.ignore_patterns("mlflow.db", "reports"))
    args = [
        "tune",
        "--params",
        "params.yaml",
        "-S",
        "tune.num_samples=2",
        "-S",
        "tune.max_epochs=1",
    ]
    out = _sat([*args, "--address", ray_head_with_dashboard], tracking_server, project)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the job's own output (the entrypoint line Ray prints, the sweep's result) came through
    assert "Running entrypoint for job" in out.stdout
    assert "--address auto" in out.stdout  # inside the job the command runs on the cluster
    assert "best val_bleu_4 = " in out.stdout
    assert "Traceback" not in out.stderr
    # the job wrote into the (shared) project folder and logged to the tracking server
    assert (project / "reports" / "tune" / "best_params.yaml").is_file()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_server)
    experiment = client.get_experiment_by_name("sat")
    assert experiment is not None
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`sat.sweep` = '1'")
    children = client.search_runs(
        [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert len(children) == 2
    for child in children:
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_bleu_4")] == [1]
    assert not (project / "mlflow.db").exists()  # nothing went to a local store instead


def test_a_failed_job_ends_sat_with_one_line_and_a_non_zero_status(
    ray_head_with_dashboard: str, tiny_project: Path
) -> None:
    # params that validate here but fail in the job: a tracking server nobody listens on
    closed = f"http://127.0.0.1:{free_port()}"
    args = ["tune", "--params", str(tiny_project / "params.yaml"), "-S", "mlflow.retries=0"]
    out = _sat([*args, "--address", ray_head_with_dashboard], closed, tiny_project)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sat tune: error:" in out.stdout  # the job's own one line, streamed
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sat tune: error: Ray job "), out.stderr
    assert "FAILED (exit status 1)" in last
    assert "Traceback" not in out.stderr
