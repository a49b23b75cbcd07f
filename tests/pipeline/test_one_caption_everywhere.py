"""The same photo gets the same caption whichever way it enters.

50 photos of the Flickr8k sample go through every way a user meets the model: `sat caption`
(offline, the champion from the registry), `sat serve` over real HTTP with base64 JSON, `sat
serve --engine ray` over HTTP, `sat caption DIR --engine ray` (Ray Data; run twice into one folder,
each run quiet but for its result) and the extract stage's
features decoded as the evaluate stage decodes them. One model serves all: a tiny one trained on
these photos' captions (so its captions differ from photo to photo), registered as the champion
of a SQLite store. Every way must give the captions of the extract stage's features, all 50.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import promote_if_better
from sat_model.features.encoders import build_encoder
from sat_model.features.extract import ImageItem, extract_split
from sat_model.features.images import Preprocessing
from sat_model.features.store import FeatureStore
from tests.factories import sample_photos, write_trained_tiny_model
from tests.pipeline.servers import post_images, sat_serve

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.mlflow]
SAT = Path(sys.executable).with_name("sat")
NAME = "sat-captioner"
PHOTOS = 50
DECODING = {"beam_size": 2, "max_length": 12, "length_penalty": 1.0}
PARAMS = """\
mlflow: {{tracking_uri: '{uri}'}}
eval: {{beam_size: 2, max_length: 12, length_penalty: {{soft: 1.0, hard: 1.0}}}}
ray: {{num_cpus: 2}}
serve:
  max_request_bytes: 20000000
  max_rows: 64
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Photos in ``photos/``, the trained champion in ``mlflow.db``, and ``params.yaml``."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("one-caption")
    (root / "photos").mkdir()
    for photo in sample_photos(PHOTOS):
        shutil.copy(photo, root / "photos" / photo.name)
    model = write_trained_tiny_model(root / "model", sorted((root / "photos").iterdir()))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    registered = log_and_register(
        client,
        model_dir=model,
        model_name=NAME,
        experiment_id=client.create_experiment("one", artifact_location=str(root / "artifacts")),
        metrics={"bleu_4": 0.1},
        params={},
        tags={"attention": "soft"},
        decoding=DECODING,
    )
    promote_if_better(client, NAME, registered.version, "bleu_4")
    (root / "params.yaml").write_text(PARAMS.format(uri=uri))
    return root


def _photos(project: Path) -> list[Path]:
    return sorted((project / "photos").iterdir())


def _env() -> dict[str, str]:
    drop = ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _sat(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(SAT), *args], cwd=project, env=_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _served_captions(project: Path, *engine: str) -> dict[str, str]:
    """Every photo posted as base64 JSON to ``sat serve`` (``engine``)."""
    photos = _photos(project)
    log = project / f"serve{'-'.join(engine)}.log"
    with sat_serve(project, list(engine), _env(), log) as served:
        predictions = post_images(served.url, photos)
    assert all(p["error"] is None for p in predictions), predictions
    return {p.name: r["caption"] for p, r in zip(photos, predictions, strict=True)}


def _offline_captions(project: Path) -> dict[str, str]:
    done = _sat(project, "caption", "photos", "--format", "jsonl")
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {Path(r["path"]).name: r["caption"] for r in rows}


def _ray_data_captions(project: Path) -> dict[str, str]:
    """``sat caption photos --engine ray --out ray-out`` twice, as a user runs it again: each
    run prints its result only (Ray Data's actor pools make Ray's core log an error line about
    restarts on every run: none may reach the user), and the second replaces the first's files
    (the same names), adding none."""
    written = []
    for _ in range(2):
        done = _sat(project, "caption", "photos", "--engine", "ray", "--out", "ray-out")
        assert done.stderr == "", done.stderr
        assert done.stdout.startswith(f"captioned {PHOTOS} of {PHOTOS} images into "), done.stdout
        assert len(done.stdout.splitlines()) == 1, done.stdout
        written.append(sorted(p.name for p in (project / "ray-out").iterdir()))
    assert written[0] == written[1] and written[0][0] == "captions_000000.json", written
    rows = [
        json.loads(line)
        for part in sorted((project / "ray-out").glob("*.json*"))
        for line in part.read_text().splitlines()
    ]
    assert all(r["error"] is None for r in rows) and len(rows) == PHOTOS, rows
    return {Path(r["path"]).name: r["caption"] for r in rows}


def _extracted_captions(project: Path) -> dict[str, str]:
    """The extract stage's features of the photos, decoded as the evaluate stage decodes."""
    from sat_model.evaluation.evaluate import decode_split
    from sat_model.features.spec import EncoderSpec
    from sat_model.model.checkpoint import load_checkpoint, load_model
    from sat_model.model.decoding import Decoding

    model_dir = project / "model"
    spec = EncoderSpec.from_config(load_checkpoint(model_dir).config, model_dir)
    assert spec.resize is not None
    encoder = build_encoder(spec.name, spec.layer, input_size=spec.input_size)
    items = [ImageItem(p.name, str(p)) for p in _photos(project)]
    store_path = project / "features" / "test.arrow"
    prep = Preprocessing(spec.resize, spec.input_size, keep_aspect=spec.keep_aspect)
    extract_split(encoder, items, store_path, prep, 16, 0, "test", progress=False)
    model, vocab, _ = load_model(model_dir)
    ids = [item.image_id for item in items]
    found = decode_split(model, vocab, FeatureStore(store_path), ids, Decoding(**DECODING))
    return {c.image_id: c.text for c in found}


@pytest.fixture(scope="module")
def expected(project: Path) -> dict[str, str]:
    """The captions of the extract stage's features: what every other way must give."""
    return _extracted_captions(project)


def test_the_model_tells_the_photos_apart(project: Path, expected: dict[str, str]) -> None:
    assert sorted(expected) == [p.name for p in _photos(project)]
    # a model that says one thing of every photo would make the comparisons below prove nothing
    assert len(set(expected.values())) >= PHOTOS // 2, expected


def _assert_same(way: str, captions: dict[str, str], expected: dict[str, str]) -> None:
    differ = [n for n in sorted(expected) if captions.get(n) != expected[n]]
    assert not differ, f"{way}: {len(differ)} of {len(expected)} differ, e.g. {differ[:3]}"


def test_sat_caption_gives_the_extract_stage_captions(project: Path, expected) -> None:
    _assert_same("sat caption", _offline_captions(project), expected)


def test_sat_serve_gives_the_extract_stage_captions(project: Path, expected) -> None:
    _assert_same("sat serve", _served_captions(project), expected)


def test_sat_serve_on_ray_gives_the_extract_stage_captions(project: Path, expected) -> None:
    _assert_same("sat serve --engine ray", _served_captions(project, "--engine", "ray"), expected)


def test_sat_caption_on_ray_data_gives_the_extract_stage_captions(project: Path, expected) -> None:
    _assert_same("sat caption --engine ray", _ray_data_captions(project), expected)
