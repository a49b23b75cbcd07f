"""Photos far from the training data are flagged, whichever way they are captioned.

A scenes model as the default pipeline makes it: generated scenes prepared and extracted by the
prepare and extract stages with the default encoder (EfficientNet-Lite0, the one whose features
mean something of a photo), a small decoder trained by ``train_model``, which records the drift
statistics of the train features and the validation photos' threshold in the model folder. It
is registered as the champion of a SQLite store. Then the scenes' own test images and photos of
real scenes from the Flickr8k sample go, in one folder, through ``sat caption`` (local and Ray
Data), ``sat serve`` (both engines) over real HTTP with base64 JSON, and MLflow's pyfunc of the
registered version. Every way must flag every photo and no more than a stray scene (the threshold
is the 0.99 quantile of the validation scenes: about 1 in 100 scenes of the training distribution
is past it), and the ways must agree photo by photo.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import sample_photos
from tests.pipeline.servers import post_images, sat_serve

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.mlflow]
SAT = Path(sys.executable).with_name("sat")
NAME = "sat-captioner"
PHOTOS, SCENES = 12, 20
DECODING = {"beam_size": 2, "max_length": 12, "length_penalty": 1.0}
PARAMS = """\
data:
  synthetic: {{train_images: 200, val_images: 50, test_images: {scenes}}}
  vocab: {{min_count: 1}}
encoder: {{batch_size: 16, num_workers: 0, torch_threads: 2}}
model: {{embed_dim: 16, hidden_dim: 32, attention_dim: 16}}
train:
  val_images: 10
  soft: {{max_epochs: 1, batch_size: 64}}
eval: {{beam_size: 2, max_length: 12, length_penalty: {{soft: 1.0, hard: 1.0}}}}
mlflow: {{tracking_uri: '{uri}'}}
ray: {{num_cpus: 2}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scenes model trained and registered as the champion; ``mixed/`` holds the test
    scenes (``.png``) and the photos (``.jpg``)."""
    from mlflow import MlflowClient

    from pipeline.stages import extract, load_context, prepare
    from pipeline.tracking.packaging import log_and_register
    from pipeline.tracking.registry import promote_if_better
    from sat_model.train.run import TrainFolders, train_model

    root = tmp_path_factory.mktemp("drift")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    (root / "params.yaml").write_text(PARAMS.format(scenes=SCENES, uri=uri))
    ctx = load_context(root / "params.yaml")
    assert prepare.run(ctx) == 0 and extract.run(ctx) == 0
    data = root / "data"
    train_model(
        ctx.params, "soft", TrainFolders(data / "prepared", data / "features", root / "models")
    )
    client = MlflowClient(uri)
    registered = log_and_register(
        client,
        model_dir=root / "models" / "soft",
        model_name=NAME,
        experiment_id=client.create_experiment("drift", artifact_location=str(root / "art")),
        metrics={"bleu_4": 0.1},
        params={},
        tags={"attention": "soft"},
        decoding=DECODING,
    )
    promote_if_better(client, NAME, registered.version, "bleu_4")
    mixed = root / "mixed"
    mixed.mkdir()
    for image in [*sample_photos(PHOTOS), *(data / "prepared" / "images").glob("test_*.png")]:
        shutil.copy(image, mixed / image.name)
    return root


def _flags(rows: dict[str, dict]) -> dict[str, bool]:
    """Each file's flag, after checking every row has a score and the counts: every photo
    flagged, at most two of the scenes."""
    assert all(r["error"] is None and isinstance(r["drift"], float) for r in rows.values()), rows
    flags = {name: r["drifted"] for name, r in rows.items()}
    photos = [f for n, f in flags.items() if n.endswith(".jpg")]
    scenes = [f for n, f in flags.items() if n.endswith(".png")]
    assert len(photos) == PHOTOS and len(scenes) == SCENES, sorted(flags)
    assert all(photos), rows
    assert sum(scenes) <= 2, rows
    return flags


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}


def _sat(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(SAT), *args], cwd=project, env=_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def offline(project: Path) -> dict[str, bool]:
    """``sat caption mixed --format jsonl``: the flags every other way must give."""
    done = _sat(project, "caption", "mixed", "--format", "jsonl")
    rows = {Path(r["path"]).name: r for r in map(json.loads, done.stdout.splitlines())}
    flags = _flags(rows)
    # the summary on stderr counts the flagged rows
    assert f"sat caption: {sum(flags.values())} of {PHOTOS + SCENES} photos far" in done.stderr
    return flags


def test_training_records_the_statistics_of_the_train_features(project: Path) -> None:
    config = json.loads((project / "models" / "soft" / "config.json").read_text())
    drift = config["drift"]
    assert drift["train_images"] == 200 and drift["val_images"] == 50  # the params' splits
    assert len(drift["mean"]) == 112  # EfficientNet-Lite0's blocks.4: D = 112


def test_sat_caption_marks_each_flagged_photo_in_its_text_line(
    project: Path,
    offline: dict[str, bool],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeline.cli.main import main

    monkeypatch.chdir(project)  # in this process: torch and the encoder are loaded already
    assert main(["caption", "mixed", "--model", "models/soft"]) == 0
    out, err = capsys.readouterr()
    marked = {
        Path(line.split(": ", 1)[0]).name
        for line in out.splitlines()
        if line.endswith("far from the training photos]")
    }
    assert marked == {name for name, flag in offline.items() if flag}
    assert f"{len(marked)} of {PHOTOS + SCENES} photos far from the training photos" in err


def test_sat_caption_on_ray_data_flags_the_same_photos(
    project: Path, offline: dict[str, bool]
) -> None:
    done = _sat(project, "caption", "mixed", "--engine", "ray", "--out", "ray-out")
    rows = {
        Path(r["path"]).name: r
        for part in sorted((project / "ray-out").glob("*.json"))
        for r in map(json.loads, part.read_text().splitlines())
    }
    assert _flags(rows) == offline
    total = PHOTOS + SCENES
    assert f"; {sum(offline.values())} of {total} photos far from the training" in done.stdout


def _served_rows(project: Path, *engine: str) -> dict[str, dict]:
    """Every image of ``mixed/`` posted as base64 JSON to ``sat serve`` (``engine``)."""
    images = sorted((project / "mixed").iterdir())
    log = project / f"serve{'-'.join(engine)}.log"
    with sat_serve(project, list(engine), _env(), log) as served:
        predictions = post_images(served.url, images)
    return {p.name: r for p, r in zip(images, predictions, strict=True)}


@pytest.mark.parametrize("engine", [(), ("--engine", "ray")], ids=["local", "ray"])
def test_sat_serve_flags_the_same_photos(
    project: Path, offline: dict[str, bool], engine: tuple[str, ...]
) -> None:
    assert _flags(_served_rows(project, *engine)) == offline


def test_the_registered_pyfunc_carries_the_statistics(
    project: Path, offline: dict[str, bool]
) -> None:
    import mlflow
    import pandas as pd

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    images = sorted((project / "mixed").iterdir())
    frame = pd.DataFrame({"image": [base64.b64encode(p.read_bytes()).decode() for p in images]})
    rows = model.predict(frame).to_dict("records")
    assert _flags({p.name: row for p, row in zip(images, rows, strict=True)}) == offline
