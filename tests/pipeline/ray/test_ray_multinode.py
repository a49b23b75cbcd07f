"""The cluster tests: two Ray nodes on 127.0.0.1, runs and inputs in a real S3 store (moto).

One cluster for the module (a head with the dashboard that serves Ray Jobs, a second node, a
moto S3 server, an ``mlflow server``), every process stopped by its own process group at the end:

- ``sat tune --address http://127.0.0.1:<dashboard>`` submits the sweep as a Ray Job, exactly as
  the README's "Scaling out" shows: inside the job the tune stage joins the cluster by its GCS
  address (``--address auto``, as a driver on a machine of the cluster does), its trial runs on
  the cluster's workers and is found in MLflow; a job that fails ends ``sat`` with one line and
  a non-zero status.
- A DDP run of two workers, one per node (``STRICT_SPREAD``), trains from inputs the driver
  uploaded to ``s3://``, checkpoints there, loses the second node's raylet (SIGKILL) mid-run,
  resumes from the store once the node is back (``ray start --address`` again), and the model
  copied to ``models/soft/`` is the last checkpoint in the store. The driver runs in a
  subprocess (a process joins one Ray cluster only) as ``__main__``, so its epoch hook travels by
  value. It kills a node, so it runs last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.ray.runtime import loopback_env
from tests.factories import ROOT
from tests.pipeline.ray_cluster import RayNodes, ray_nodes
from tests.pipeline.servers import free_port, mlflow_server, s3_server, stop_process_group

pytestmark = [pytest.mark.cluster, pytest.mark.ray, pytest.mark.mlflow, pytest.mark.slow]

BIN = Path(sys.executable).parent
EPOCHS = 2
KILL_EPOCH = 1  # 0-based: the node dies in the second epoch, the first is in the store
PHOTOS = 29  # good photos in the bucket, beside three corrupt files: two batches of 16

DRIVER = """
import json, os, sys, time
from pathlib import Path
from pipeline.ray.train import WorkerHooks, train_with_ray
from pipeline.settings import load_params

params_file, address, log = sys.argv[1:4]

def on_epoch_start(run, epoch):
    import ray
    node = ray.get_runtime_context().get_node_id()
    resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node)
    line = {"rank": run.rank, "epoch": epoch, "pid": os.getpid(), "node2": "node2" in resources}
    with open(log, "a") as f:
        f.write(json.dumps(line) + "\\n")
    time.sleep(3.0)  # room for the test to kill the node while an epoch runs

params = load_params(params_file)
out = train_with_ray(params, "soft", project_root=Path(params_file).parent, address=address,
                     hooks=WorkerHooks(on_epoch_start=on_epoch_start))
print(json.dumps({"run_name": out.run_name, "run_id": out.mlflow_run_id}))
"""


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]  # for drivers and `sat`: loopback Ray, token auth, S3 endpoint
    nodes: RayNodes
    tracking_uri: str  # the mlflow server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    with s3_server(tmp) as s3:
        s3.create_bucket("sat-runs")
        env = {**loopback_env(), **s3.env, "RAY_AUTH_MODE": "token"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop("RAY_ADDRESS", None)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # a Ray Job's `python` is this one
        env["RAY_health_check_period_ms"] = "1000"  # the dead node is noticed in seconds
        env["RAY_health_check_failure_threshold"] = "3"
        backend = f"sqlite:///{tmp / 'mlflow-server.db'}"
        with (
            mlflow_server(tmp, backend, str(tmp / "mlartifacts")) as tracking_uri,
            ray_nodes(tmp, env, {"node2": 1}, dashboard=True) as nodes,
        ):
            yield Cluster(env, nodes, tracking_uri)


def _sat(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "sat"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=500
    )


@pytest.mark.java
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_sat_tune_submitted_as_a_ray_job_streams_its_log_and_logs_its_trials(
    cluster: Cluster, tiny_project: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(tiny_project, project, ignore=shutil.ignore_patterns("mlflow.db", "reports"))
    overrides = ["tune.num_samples=1", "tune.max_epochs=1", "ray.storage_path=s3://sat-runs/tune"]
    args = ["tune", "--params", "params.yaml", *(f"-S{o}" for o in overrides)]
    env = {**cluster.env, "MLFLOW_TRACKING_URI": cluster.tracking_uri}
    out = _sat([*args, "--address", cluster.nodes.dashboard_url], env, project)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the job's own output (the entrypoint line Ray prints, the sweep's result) came through
    assert "Running entrypoint for job" in out.stdout
    assert "--address auto" in out.stdout  # inside the job the command runs on the cluster
    assert "best val_bleu_4 = " in out.stdout
    assert "Traceback" not in out.stderr
    # the trial table, streamed: a header and a row for the trial's end
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["trial", "status", "epoch", "lr", "doubly_stochastic", "val_bleu_4"] in rows
    assert sum(len(row) == 6 and row[1] == "done" for row in rows) == 1, out.stdout[-3000:]
    # the job wrote into the (shared) project folder and logged to the tracking server
    assert (project / "reports" / "tune" / "best_params.yaml").is_file()
    from mlflow import MlflowClient

    client = MlflowClient(cluster.tracking_uri)
    experiment = client.get_experiment_by_name("sat")
    assert experiment is not None
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`sat.sweep` = '1'")
    children = client.search_runs(
        [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    (child,) = children
    assert [m.step for m in client.get_metric_history(child.info.run_id, "val_bleu_4")] == [1]
    assert not (project / "mlflow.db").exists()  # nothing went to a local store instead


def test_a_failed_job_ends_sat_with_one_line_and_a_non_zero_status(
    cluster: Cluster, tiny_project: Path
) -> None:
    # params that validate here but fail in the job: a tracking server nobody listens on
    env = {**cluster.env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    args = ["tune", "--params", str(tiny_project / "params.yaml"), "-S", "mlflow.retries=0"]
    out = _sat([*args, "--address", cluster.nodes.dashboard_url], env, tiny_project)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sat tune: error:" in out.stdout  # the job's own one line, streamed
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sat tune: error: Ray job "), out.stderr
    assert "FAILED (exit status 1)" in last
    assert "Traceback" not in out.stderr


def _read_log(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_ddp_project(tiny_project: Path, project: Path, tracking_uri: str) -> Path:
    """Copies the tiny project and sets a two-worker STRICT_SPREAD run that checkpoints to S3
    and may fail twice; returns its params file."""
    shutil.copytree(tiny_project, project, ignore=shutil.ignore_patterns("mlflow.db", "reports"))
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["soft"]["max_epochs"] = EPOCHS
    params["mlflow"] = {"tracking_uri": tracking_uri}
    params["ray"] = {
        "num_cpus": 1,
        "num_workers": 2,
        "cpus_per_worker": 1,
        "max_failures": 2,
        "storage_path": "s3://sat-runs/ray",
        "placement_strategy": "STRICT_SPREAD",
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    return project / "params.yaml"


def _train_killing_node2_mid_run(
    cluster: Cluster, params_file: Path, log: Path, driver_log: Path
) -> tuple[subprocess.Popen[str], str, list[dict[str, object]]]:
    """Runs the DDP driver, kills node2's raylet once both workers are in KILL_EPOCH and starts
    it again; returns the finished driver, its stdout and the epoch log as it was at the kill."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(params_file), cluster.nodes.address, str(log)],
        env=cluster.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=driver_log.open("wb"),
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while sum(e["epoch"] == KILL_EPOCH for e in _read_log(log)) < 2:  # both workers in it
            assert driver.poll() is None, driver_log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"epoch {KILL_EPOCH} never started:\n{driver_log.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        before = _read_log(log)
        cluster.nodes.kill_raylet("node2")  # while the epoch sleeps in its hook: mid-run
        cluster.nodes.restart("node2")  # same `ray start --address` command: the run may resume
        stdout, _ = driver.communicate(timeout=400)
    finally:
        stop_process_group(driver)
    return driver, stdout, before


def _assert_spread_and_resumed_after_the_kill(
    entries: list[dict[str, object]], before: list[dict[str, object]]
) -> None:
    """Placement: every epoch ran on both nodes, one worker each (STRICT_SPREAD); which rank
    lands on which node is Ray's choice. Epochs in the hook count from 0."""
    for epoch in range(EPOCHS):
        nodes = {e["node2"] for e in entries if e["epoch"] == epoch}
        assert nodes == {False, True}, (epoch, entries)
    # the kill hit mid-run (KILL_EPOCH had started) and new workers resumed from the store
    killed = {e["pid"] for e in before if e["node2"]}
    after = [e for e in entries if e["node2"] and e["pid"] not in killed]
    assert len(killed) == 1 and after, "no worker on node2 restarted: the kill missed the run"
    assert max(e["epoch"] for e in before) == KILL_EPOCH
    assert after[0]["epoch"] == KILL_EPOCH  # resumed from the epoch before's checkpoint in S3
    assert max(e["epoch"] for e in after) == EPOCHS - 1


def _assert_the_stores_last_checkpoint_was_shipped(
    env: dict[str, str], run_name: str, model_dir: Path
) -> None:
    """models/soft/ holds exactly the last checkpoint of the run in the store, and loads; the
    inputs were uploaded once."""
    import pyarrow.fs as pafs

    from sat_model.model.checkpoint import load_checkpoint

    s3 = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], region="us-east-1")
    run_dir = f"sat-runs/ray/{run_name}"
    with s3.open_input_stream(f"{run_dir}/sat_run.json") as f:
        record = json.loads(f.read())
    assert record["status"] == "FINISHED"
    checkpoint = f"{run_dir}/{record['checkpoint']}"
    stored = {
        info.path.removeprefix(checkpoint + "/"): info
        for info in s3.get_file_info(pafs.FileSelector(checkpoint, recursive=True))
        if info.type == pafs.FileType.File
    }
    shipped = {str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file()}
    assert shipped == set(stored) and "model.safetensors" in shipped
    for name in shipped:
        with s3.open_input_stream(stored[name].path) as f:
            assert f.read() == (model_dir / name).read_bytes(), name
    loaded = load_checkpoint(model_dir)
    assert loaded is not None
    inputs = s3.get_file_info(pafs.FileSelector("sat-runs/ray/inputs/sha256"))
    assert len(inputs) == 4  # captions, vocabulary, train and val features, uploaded once


@pytest.mark.java
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_ddp_on_two_nodes_survives_a_killed_raylet_and_ships_the_stores_checkpoint(
    cluster: Cluster, tiny_project: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    params_file = _write_ddp_project(tiny_project, project, cluster.tracking_uri)
    log, driver_log = tmp_path / "epochs.jsonl", tmp_path / "driver.log"
    driver, stdout, before = _train_killing_node2_mid_run(cluster, params_file, log, driver_log)
    assert driver.returncode == 0, driver_log.read_text()[-3000:]
    outcome = json.loads(stdout.strip().splitlines()[-1])
    # the driver printed a progress line for every epoch, across the restart
    said = driver_log.read_text()
    pattern = rf"^train soft  epoch (\d)/{EPOCHS}  loss \S+  val BLEU-4 \S+  CIDEr \S+"
    pattern += r"  \d+ captions/s"
    progress = re.findall(pattern, said, re.M)
    assert sorted(set(progress)) == [str(e) for e in range(1, EPOCHS + 1)], said[-3000:]

    _assert_spread_and_resumed_after_the_kill(_read_log(log), before)

    # each epoch logged once to the tracking server
    from mlflow import MlflowClient

    history = MlflowClient(cluster.tracking_uri).get_metric_history(outcome["run_id"], "train_loss")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))

    _assert_the_stores_last_checkpoint_was_shipped(
        cluster.env, outcome["run_name"], project / "models" / "soft"
    )


def test_a_bucket_of_photos_is_captioned_by_ray_data_on_the_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    """32 sample photos in S3, three corrupt: ``sat caption s3://... --engine ray`` on the two
    nodes writes 32 rows to the bucket, three with errors, the rest as ``sat caption`` captions
    the same files in one process."""
    import boto3

    from sat_model.paths import shared_data
    from tests.factories import write_tiny_model

    photos = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
    if not photos.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({photos})")
    local = tmp_path / "photos"
    local.mkdir()
    for photo in sorted(photos.glob("*.jpg"))[:PHOTOS]:
        (local / photo.name).symlink_to(photo)
    whole = next(photos.glob("*.jpg")).read_bytes()
    corrupt = {"cut.jpg": whole[: len(whole) // 2], "text.jpg": b"not a photo", "empty.png": b""}
    for name, data in corrupt.items():
        (local / name).write_bytes(data)
    env = cluster.env
    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    for path in sorted(local.iterdir()):
        s3.put_object(Bucket="sat-runs", Key=f"photos/{path.name}", Body=path.read_bytes())
    model = write_tiny_model(tmp_path / "model", words=("a", "dog", "runs", "red"), resize=72)
    common = ["--model", str(model), "--batch-size", "16", "--format", "jsonl"]
    on_ray = ["--engine", "ray", "--address", cluster.nodes.address]
    source, dest = "s3://sat-runs/photos", "s3://sat-runs/captions"
    out = _sat(["caption", source, "--out", dest, *on_ray, *common], env, tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    total = PHOTOS + len(corrupt)
    assert f"captioned {PHOTOS} of {total} images into s3://sat-runs/captions" in out.stdout
    rows = []
    listing = s3.list_objects_v2(Bucket="sat-runs", Prefix="captions/")["Contents"]
    for item in listing:
        body = s3.get_object(Bucket="sat-runs", Key=item["Key"])["Body"].read().decode()
        rows += [json.loads(line) for line in body.splitlines() if line]
    by_name = {Path(r["path"]).name: r for r in rows}
    assert len(rows) == total and len(by_name) == total  # every file once: none lost or doubled
    assert sorted(n for n, r in by_name.items() if r["error"]) == sorted(corrupt)
    one_process = _sat(["caption", str(local), *common], env, tmp_path)
    expected = {
        Path(r["path"]).name: r["caption"]
        for r in map(json.loads, one_process.stdout.splitlines())
        if r["caption"]
    }
    assert len(expected) == PHOTOS
    assert {n: r["caption"] for n, r in by_name.items() if r["caption"]} == expected
