"""Faults while stages run: a killed ``extract``, a tracking server that is down during
``register``, a METEOR process that never answers, and what listens on the network.

Each test reproduces the fault for real (SIGKILL to a stage subprocess, a tracking URI whose
port nobody listens on, then a real ``mlflow server`` started there, a real Java METEOR with a
timeout it cannot meet, a real local Ray cluster) and checks the promise in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sat_model.features.encoders import build_encoder
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureStore, FeatureWriter
from tests.factories import ROOT, write_references, write_tiny_model
from tests.pipeline.servers import free_port, mlflow_server


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env | extra


# ------------------------------------------------------------------- extract killed half-way
def _extract_project(root: Path, count: int) -> None:
    prepared = root / "data" / "prepared"
    (prepared / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        path = prepared / "images" / f"i{i:04d}.png"
        if not path.exists():
            Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path)
    ids = [f"i{i:04d}" for i in range(count)]
    table = pa.table(
        {
            "image_id": ids,
            "split": ["train"] * count,
            "file": [f"{i}.png" for i in ids],  # under <prepared_dir>/images (synthetic root)
            "width": pa.array([40] * count, pa.int32()),
            "height": pa.array([40] * count, pa.int32()),
            "status": ["ok"] * count,
        }
    ).replace_schema_metadata({"image_root": str(prepared / "images"), "source": "synthetic"})
    pq.write_table(table, prepared / "images.parquet")
    params = {
        "encoder": {
            "name": "random",
            "resize": 36,
            "crop": 32,
            "batch_size": 2,
            "num_workers": 0,
            "torch_threads": 1,
        }
    }
    (root / "params.yaml").write_text(json.dumps(params))


def _extract(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.stages.extract"],
        cwd=root,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_extract_killed_half_way_never_exposes_a_partial_store_and_reruns_cleanly(
    tmp_path: Path,
) -> None:
    features = tmp_path / "data" / "features"
    store = features / "train.arrow"
    _extract_project(tmp_path, 40)
    first = _extract(tmp_path)
    assert first.wait(timeout=300) == 0, first.stderr.read().decode()
    previous = store.read_bytes()  # the complete store of the 40-image table

    _extract_project(tmp_path, 600)  # a bigger table: the next run takes a while
    run = _extract(tmp_path)
    deadline, seen_partial, reads = time.monotonic() + 240, False, 0
    while time.monotonic() < deadline and run.poll() is None:
        partials = list(features.glob(".train.arrow.*.partial"))
        if partials and partials[0].stat().st_size > 4096:  # some batches are written
            seen_partial = True
            break
        assert FeatureStore(store).ids[-1] == "i0039"  # a reader meanwhile: the old store
        reads += 1
        time.sleep(0.01)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert seen_partial, "the run ended before it could be killed half-way"
    assert reads > 0
    assert store.read_bytes() == previous  # the visible store is still the previous one
    assert list(features.glob(".train.arrow.*.partial"))  # SIGKILL left the temp file behind

    again = _extract(tmp_path)
    assert again.wait(timeout=300) == 0, again.stderr.read().decode()
    rerun = FeatureStore(store)
    assert rerun.ids == [f"i{i:04d}" for i in range(600)]
    assert np.isfinite(rerun.get_batch([0, 599]).astype(np.float32)).all()
    assert not list(features.glob(".*.partial"))  # the dead run's temp file was removed


def test_a_live_writers_temp_file_is_left_alone(tmp_path: Path) -> None:
    spec = EncoderSpec("random", "none", 32, 4, 6, 2, 2, "0" * 64)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".train.arrow.{sleeper.pid}.partial"
        live.write_bytes(b"another process is writing this")
        dead = tmp_path / ".train.arrow.999999999.partial"  # above any Linux pid_max
        dead.write_bytes(b"left by a killed run")
        with FeatureWriter(tmp_path / "train.arrow", spec) as writer:
            writer.write(["a"], np.zeros((1, 4, 6), np.float16))
        assert live.exists() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------ MLflow down at register
def _register_project(root: Path) -> None:
    write_tiny_model(root / "models" / "soft", crop=32, resize=36)
    reports = root / "reports" / "soft"
    reports.mkdir(parents=True)
    (reports / "metrics.json").write_text(json.dumps({"bleu_4": 0.1, "cider": 0.2}))
    (root / "params.yaml").write_text("mlflow: {retries: 1}\n")


def _tree_digest(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _register(root: Path, uri: str) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.stages.register"],
        cwd=root,
        env=_env(MLFLOW_TRACKING_URI=uri),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.mark.mlflow
@pytest.mark.slow
def test_register_with_the_server_down_fails_clearly_then_succeeds_once_it_is_back(
    tmp_path: Path,
) -> None:
    from mlflow import MlflowClient

    project, server_root = tmp_path / "project", tmp_path / "server"
    project.mkdir()
    server_root.mkdir()
    _register_project(project)
    port = free_port()  # nobody listens on it until the server starts there below
    uri = f"http://sat-user:s3cret-token@127.0.0.1:{port}"  # credentials must never be shown
    backend, artifacts = (
        f"sqlite:///{server_root / 'server.db'}",
        str(server_root / "server-artifacts"),
    )
    before = _tree_digest(project / "models") | _tree_digest(project / "reports")

    code, output, seconds = _register(project, uri)
    assert code == 1
    assert "failed after 2 attempt(s)" in output and "register: error" in output
    assert "Traceback" not in output
    assert seconds < 90  # bounded: MLflow's own HTTP retries would take minutes
    assert "s3cret-token" not in output and "***@127.0.0.1" in output
    assert _tree_digest(project / "models") | _tree_digest(project / "reports") == before
    assert not (project / "reports" / "registry.json").exists()

    with mlflow_server(server_root, backend, artifacts, port=port):
        code, output, _ = _register(project, uri)
        assert code == 0, output
        assert "s3cret-token" not in output
        client = MlflowClient(f"http://127.0.0.1:{port}")
        versions = client.search_model_versions("name = 'sat-captioner'")
        assert len(versions) == 1  # the failed attempt registered nothing half-way
        registry = json.loads((project / "reports" / "registry.json").read_text())
        assert [v["reused"] for v in registry["versions"]] == [False]
        run = client.get_run(versions[0].run_id)
        logged = json.dumps([run.data.params, run.data.tags, versions[0].tags])
        assert "s3cret-token" not in logged and "sat-user" not in logged
        # on a tracking server the artifacts go to the server's --artifacts-destination, never
        # to a folder of the client's (mlflow.artifact_root is a local path here)
        assert not list((project / "mlartifacts").rglob("MLmodel"))
        (mlmodel,) = (server_root / "server-artifacts").rglob("MLmodel")
        _assert_model_is_code_not_pickle(mlmodel.parent)


def _assert_model_is_code_not_pickle(model_dir: Path) -> None:
    """The logged pyfunc holds source files and tensors, no pickled Python object."""
    import yaml

    local = model_dir
    files = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".cloudpickle"))], files
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    # models-from-code: MLflow's code loader runs the logged source file, no python_model.pkl
    assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert "pyfunc_model.py" in files and "python_model.pkl" not in files
    assert {"checkpoint/model.safetensors", "checkpoint/config.json", "checkpoint/vocab.json"} <= {
        f.split("artifacts/", 1)[-1] for f in files
    }


def test_redact_removes_userinfo_from_every_url_in_a_message() -> None:
    from pipeline.tracking.store import redact

    text = (
        "API request to http://alice:pa55@10.0.0.1:5000/api failed; "
        "retry https://tok@host/x; sqlite:////tmp/mlflow.db; user@example.org"
    )
    assert redact(text) == (
        "API request to http://***@10.0.0.1:5000/api failed; "
        "retry https://***@host/x; sqlite:////tmp/mlflow.db; user@example.org"
    )


# --------------------------------------------------------------------- METEOR stuck (stage)
def _evaluate_project(root: Path) -> None:
    prepared = root / "data" / "prepared"
    (prepared / "images").mkdir(parents=True)
    ids = ["t0", "t1"]
    for image_id in ids:
        Image.new("RGB", (40, 40), (200, 30, 30)).save(prepared / "images" / f"{image_id}.png")
    rows = [
        dict(image_id=i, split="test", file=f"{i}.png", width=40, height=40, status="ok", boxes=[])
        for i in ids
    ]
    table = pa.Table.from_pylist(rows).replace_schema_metadata(
        {"image_root": str(prepared / "images"), "source": "flickr8k"}
    )
    pq.write_table(table, prepared / "images.parquet")
    write_references(prepared / "captions.parquet", {i: ["a red circle"] for i in ids})
    write_tiny_model(root / "models" / "soft", crop=32, resize=36)
    d = build_encoder("random", input_size=32).spec
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "data" / "features" / "test.arrow", d) as writer:
        writer.write(ids, rng.standard_normal((2, d.num_locations, d.annotation_dim)))
    (root / "params.yaml").write_text(
        "encoder: {name: random, resize: 36, crop: 32}\n"
        "eval: {beam_size: 1, max_length: 3, gallery_images: 1, meteor_timeout_s: 0.05}\n"
    )


@pytest.mark.java
def test_evaluate_stage_fails_saying_meteor_timed_out(
    tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stage's failure is one line that names the timeout and what to raise (status 1, as
    ``sat evaluate`` reports it), and it leaves no partial report."""
    from pipeline.stages.evaluate import main

    if shutil.which("java") is None:
        pytest.skip("METEOR needs Java")
    _evaluate_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["--attention", "soft"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("evaluate: error: METEOR timed out after")
    assert "eval.meteor_timeout_s" in line
    assert not (tmp_path / "reports" / "soft" / "metrics.json").exists()  # no partial report


# ------------------------------------------------------------------------ network exposure
def _listening_addresses(pids: set[int]) -> set[str]:
    import psutil

    out = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
    return out


@pytest.mark.ray
def test_local_ray_listens_on_loopback_only(ray_local) -> None:
    import psutil

    ray = ray_local
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    addresses = _listening_addresses(children | {os.getpid()})
    assert addresses, "found no listening Ray socket to check"
    assert addresses <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addresses


def test_no_code_starts_a_server_on_a_public_interface() -> None:
    # the pipeline starts Ray only through ray_session (checked above) and never an MLflow or
    # model server itself; any future server command must name loopback explicitly
    offenders = []
    for path in [
        *ROOT.joinpath("pipeline").rglob("*.py"),
        *ROOT.joinpath("sat_model").rglob("*.py"),
    ]:
        text = path.read_text(encoding="utf-8")
        if "0.0.0.0" in text or "dashboard_host" in text:
            offenders.append(str(path.relative_to(ROOT)))
        if ("mlflow server" in text or '"server"' in text) and "127.0.0.1" not in text:
            offenders.append(str(path.relative_to(ROOT)))
        if "ray.init(" in text and path != ROOT / "pipeline/ray/runtime.py":
            offenders.append(f"{path.relative_to(ROOT)}: ray.init outside pipeline/ray/runtime.py")
    assert offenders == []
