"""The cluster test: two Ray nodes on 127.0.0.1, runs and inputs in a real S3 store (moto).

A DDP run of two workers, one per node (``STRICT_SPREAD``), trains from inputs the driver
uploaded to ``s3://``, checkpoints there, loses the second node's raylet (SIGKILL) mid-run,
resumes from the store once the node is back (``ray start --address`` again), and the model
copied to ``models/soft/`` is the last checkpoint in the store. The driver runs in a subprocess
(a process joins one Ray cluster only) as ``__main__``, so its epoch hook travels by value.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.ray_runtime import loopback_env
from tests.pipeline.servers import free_port, mlflow_server, s3_server, stop_process_group

RAY = Path(sys.executable).with_name("ray")
REPO = Path(__file__).resolve().parents[2]
EPOCHS = 4

DRIVER = """
import json, os, sys, time
from pathlib import Path
from pipeline.ray_train import WorkerHooks, train_with_ray
from sat_model.config import load_params

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


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab"), start_new_session=True
    )


def _node_cmd(extra: list[str]) -> list[str]:
    ports = ["--dashboard-agent-listen-port", "--metrics-export-port", "--runtime-env-agent-port"]
    cmd = [str(RAY), "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1"]
    return cmd + [f"{flag}={free_port()}" for flag in ports] + extra


def _group_pids(pgid: int) -> list[tuple[int, str]]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.getpgid(int(proc.name)) == pgid:
                found.append((int(proc.name), (proc / "cmdline").read_text(errors="replace")))
        except (OSError, ProcessLookupError):
            continue
    return found


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of a node's process group and check it is gone."""
    stop_process_group(proc, timeout_s=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while _group_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_pids(proc.pid), f"ray node group {proc.pid} still running"


class TwoNodes:
    """A head (resource ``head``) and a second node (``node2``), each its own process group."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env, self.port = tmp, env, free_port()
        self.temp_dir = Path("/tmp") / f"raymn{self.port}"  # short: socket path length limit
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node2: subprocess.Popen[bytes] | None = None
        # "127.1" is 127.0.0.1 to the resolver; Ray would rewrite "127.0.0.1" to the machine's
        # address when a node joins (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1)
        self.node2_cmd = _node_cmd([f"--address=127.1:{self.port}", '--resources={"node2": 1}'])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        head = _node_cmd(
            [
                "--head",
                f"--port={self.port}",
                '--resources={"head": 1}',
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dir}",
            ]
        )
        self.procs.append(_start(head, self.env, self.tmp / "head.log"))
        self._wait_for_nodes(1)
        self.start_node2()

    def start_node2(self) -> None:
        # joining a cluster is refused with the loopback switch off (=0, pipeline.ray_runtime);
        # the explicit --node-ip-address keeps this node on 127.0.0.1 all the same
        # gRPC's own resolver does not read "127.1"; the system's (getaddrinfo) does
        env = {**self.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "GRPC_DNS_RESOLVER": "native"}
        self.node2 = _start(self.node2_cmd, env, self.tmp / "node2.log")
        self.procs.append(self.node2)
        self._wait_for_nodes(2)

    def kill_node2_raylet(self) -> int:
        assert self.node2 is not None
        group = _group_pids(self.node2.pid)
        (raylet,) = [pid for pid, cmd in group if "raylet" in cmd.split("\0")[0]]
        os.kill(raylet, signal.SIGKILL)
        _kill_group(self.node2)  # `ray start --block` and its agents go with their raylet
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

    def stop(self) -> None:
        for proc in self.procs:
            _kill_group(proc)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def store_and_cluster(tmp_path: Path) -> Iterator[tuple[dict[str, str], TwoNodes, str]]:
    with s3_server(tmp_path) as s3:
        s3.create_bucket("sat-runs")
        env = {**loopback_env(), **s3.env, "RAY_AUTH_MODE": "token"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop("RAY_ADDRESS", None)
        env["RAY_health_check_period_ms"] = "1000"  # the dead node is noticed in seconds
        env["RAY_health_check_failure_threshold"] = "3"
        backend = f"sqlite:///{tmp_path / 'mlflow-server.db'}"
        with mlflow_server(tmp_path, backend, str(tmp_path / "mlartifacts")) as tracking_uri:
            cluster = TwoNodes(tmp_path, env)
            try:
                cluster.start()
                yield env, cluster, tracking_uri
            finally:
                cluster.stop()


def _read_log(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.cluster
@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_ddp_on_two_nodes_survives_a_killed_raylet_and_ships_the_stores_checkpoint(
    store_and_cluster: tuple[dict[str, str], TwoNodes, str], tiny_project: Path, tmp_path: Path
) -> None:
    import pyarrow.fs as pafs

    from sat_model.model.checkpoint import load_checkpoint

    env, cluster, tracking_uri = store_and_cluster
    project = tmp_path / "project"
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
    log = tmp_path / "epochs.jsonl"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(project / "params.yaml"), cluster.address, str(log)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "driver.log").open("wb"),
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while sum(e["epoch"] == 2 for e in _read_log(log)) < 2:  # both workers in epoch 2
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "epoch 2 never started"
            time.sleep(0.2)
        before = _read_log(log)
        cluster.kill_node2_raylet()  # while epoch 2 sleeps in its hook: mid-run
        cluster.start_node2()  # same `ray start --address` command: the run may resume
        stdout, _ = driver.communicate(timeout=400)
    finally:
        stop_process_group(driver)
    assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    outcome = json.loads(stdout.strip().splitlines()[-1])

    # placement: every epoch ran on both nodes, one worker each (STRICT_SPREAD); which rank
    # lands on which node is Ray's choice. Epochs in the hook count from 0.
    entries = _read_log(log)
    for epoch in range(EPOCHS):
        nodes = {e["node2"] for e in entries if e["epoch"] == epoch}
        assert nodes == {False, True}, (epoch, entries)
    # the kill hit mid-run (epoch 2 of 0..3 had started) and new workers resumed from the store
    killed = {e["pid"] for e in before if e["node2"]}
    after = [e for e in entries if e["node2"] and e["pid"] not in killed]
    assert len(killed) == 1 and after, "no worker on node2 restarted: the kill missed the run"
    assert max(e["epoch"] for e in before) == 2
    assert after[0]["epoch"] == 2  # the checkpoint of epochs 0-1 in S3 was the resume point
    assert max(e["epoch"] for e in after) == EPOCHS - 1

    # each epoch logged once to the tracking server
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(outcome["run_id"], "train_loss")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))

    # models/soft/ holds exactly the last checkpoint of the run in the store
    s3 = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], region="us-east-1")
    run_dir = f"sat-runs/ray/{outcome['run_name']}"
    with s3.open_input_stream(f"{run_dir}/sat_run.json") as f:
        record = json.loads(f.read())
    assert record["status"] == "FINISHED"
    checkpoint = f"{run_dir}/{record['checkpoint']}"
    stored = {
        info.path.removeprefix(checkpoint + "/"): info
        for info in s3.get_file_info(pafs.FileSelector(checkpoint, recursive=True))
        if info.type == pafs.FileType.File
    }
    model_dir = project / "models" / "soft"
    shipped = {str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file()}
    assert shipped == set(stored) and "model.pt" in shipped
    for name in shipped:
        with s3.open_input_stream(stored[name].path) as f:
            assert f.read() == (model_dir / name).read_bytes(), name
    loaded = load_checkpoint(model_dir)
    assert loaded is not None
    inputs = s3.get_file_info(pafs.FileSelector("sat-runs/ray/inputs/sha256"))
    assert len(inputs) == 4  # captions, vocabulary, train and val features, uploaded once
