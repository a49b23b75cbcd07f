"""The same photo gets the same caption whichever way it enters.

50 photos of the Flickr8k sample go through every way a user meets the model: `sat caption`
(offline, the champion from the registry), `sat serve` over real HTTP with base64 JSON, `sat
serve --engine ray` over HTTP, `sat caption DIR --engine ray` (Ray Data) and the extract stage's
features decoded as the evaluate stage decodes them. One model serves all: a tiny one trained on
these photos' captions (so its captions differ from photo to photo), registered as the champion
of a SQLite store. Every way must give the captions of the extract stage's features, all 50.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import promote_if_better
from sat_model.features.encoders import build_encoder
from sat_model.features.extract import ImageItem, extract_split
from sat_model.features.images import Preprocessing
from sat_model.features.store import FeatureStore
from tests.factories import sample_photos, write_trained_tiny_model
from tests.pipeline.servers import free_port

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
    """Start ``sat serve`` (its process group), post every photo as base64 JSON, stop it."""
    photos = _photos(project)
    rows = [{"image": base64.b64encode(p.read_bytes()).decode()} for p in photos]
    body = json.dumps({"dataframe_records": rows}).encode()
    with _serving(project, engine) as url:
        request = urllib.request.Request(
            f"{url}/invocations", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as answer:
            predictions = json.loads(answer.read())["predictions"]
    assert all(p["error"] is None for p in predictions), predictions
    return {p.name: r["caption"] for p, r in zip(photos, predictions, strict=True)}


@contextmanager
def _serving(project: Path, engine: tuple[str, ...]) -> Iterator[str]:
    """``sat serve`` on a free port until the block ends; a port that another program took
    between our choosing it and the server binding it is tried once more with another."""
    for attempt in (1, 2):
        port = free_port()
        log = project / f"serve{'-'.join(engine)}-{attempt}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(SAT), "serve", *engine, "--port", str(port)],
                cwd=project,
                env=_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            if _ready(process, f"http://127.0.0.1:{port}/ping", log):
                yield f"http://127.0.0.1:{port}"
                return
        finally:
            _stop(process)
    raise AssertionError(f"sat serve {engine} did not start twice: {log.read_text()[-3000:]}")


def _ready(process: subprocess.Popen, health: str, log: Path) -> bool:
    """True once ``health`` answers; False if the server exited (its log says why)."""
    deadline = time.monotonic() + 300
    while process.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(health, timeout=5) as answer:
                if answer.status == 200:
                    return True
        except (OSError, http.client.HTTPException):  # not up yet, or not ours
            pass
        time.sleep(1)
    return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _offline_captions(project: Path) -> dict[str, str]:
    done = _sat(project, "caption", "photos", "--format", "jsonl")
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {Path(r["path"]).name: r["caption"] for r in rows}


def _ray_data_captions(project: Path) -> dict[str, str]:
    _sat(project, "caption", "photos", "--engine", "ray", "--out", "ray-out")
    rows = [
        json.loads(line)
        for part in sorted((project / "ray-out").glob("*.json*"))
        for line in part.read_text().splitlines()
    ]
    assert all(r["error"] is None for r in rows), rows
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
