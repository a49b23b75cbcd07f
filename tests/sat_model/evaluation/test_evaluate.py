"""Evaluating a split: decoding, scoring, grounding and the attention gallery on tiny data.

The decoder is a tiny untrained model whose output bias forbids ``<pad>``, ``<start>``, ``<end>``
and ``<unk>``, so every caption is exactly ``max_length`` words drawn from {"a", "circle"}: the
expected scores and hits below follow from that, not from running the code.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sat_model.config import EncoderConfig, EvalConfig
from sat_model.data.tables import IMAGES_FILE, IMAGES_SCHEMA
from sat_model.evaluation.evaluate import (
    DataSplit,
    EvaluationError,
    FeatureView,
    decode_split,
    evaluate_model,
    read_image_records,
    write_attention_gallery,
    write_reports,
)
from sat_model.evaluation.metrics import score_captions
from sat_model.evaluation.reports import read_metrics
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureStore, FeatureWriter
from sat_model.model.decoding import Decoding
from tests.factories import write_references, write_tiny_model
from tests.figures import figure_panels, read_index

pytestmark = pytest.mark.java  # the PTB tokeniser and METEOR run on Java

MAX_LEN = 5
GRID, CROP = 4, 64  # 4x4 cells of 16 px over a 64 px crop; cell centres at 8, 24, 40, 56


def _box(x0, y0, x1, y1):
    return dict(
        label="large red circle",
        shape="circle",
        colour="red",
        size="large",
        x0=x0,
        y0=y0,
        x1=x1,
        y1=y1,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    # img0, img1: a box over the whole photo (every peak hits); img2: a box between cell
    # centres (no peak can hit); img3: references but no features; img4: features, no refs
    boxes = {
        "img0": [_box(0, 0, 64, 64)],
        "img1": [_box(0, 0, 64, 64)],
        "img2": [_box(9, 9, 23, 23)],
        "img3": [],
        "img4": [],
    }
    rows = []
    for image_id, bxs in boxes.items():
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
            images / f"{image_id}.png"
        )
        rows.append(
            dict(
                image_id=image_id,
                split="test",
                file=f"{image_id}.png",
                width=64,
                height=64,
                status="ok",
                boxes=bxs,
            )
        )
    schema = IMAGES_SCHEMA.with_metadata({"image_root": str(images), "source": "synthetic"})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), root / IMAGES_FILE)
    refs = {
        "img0": ["a circle", "a big circle"],
        "img1": ["circle"],
        "img2": ["a circle"],
        "img3": ["a circle"],
    }
    write_references(root / "captions.parquet", refs)
    spec = EncoderSpec("random", "conv2", CROP, GRID * GRID, 32, GRID, GRID, "random-seed-0")
    with FeatureWriter(root / "test.arrow", spec) as writer:
        ids = ["img0", "img1", "img2", "img4"]
        writer.write(ids, rng.normal(size=(4, GRID * GRID, 32)).astype(np.float16))
    return root, write_tiny_model(root / "model", words=("a", "circle"), crop=CROP)


def _split(root, captions):
    return DataSplit("test", root / "test.arrow", captions, root / "images.parquet")


def _evaluate(root, model_dir, captions="captions.parquet", **kw):
    settings = EvalConfig(beam_size=2, max_length=MAX_LEN, batch_size=2)
    split = _split(root, root / captions)
    return evaluate_model(model_dir, split, settings, EncoderConfig(resize=CROP), **kw)


@pytest.fixture(scope="module")
def result(data):
    return _evaluate(*data)


def test_one_caption_per_image_with_features_and_references(result):
    assert [c.image_id for c in result.captions] == ["img0", "img1", "img2"]
    for c in result.captions:
        assert len(c.words) == MAX_LEN and set(c.words) <= {"a", "circle"}
        assert c.alphas.shape == (MAX_LEN, GRID * GRID)
    assert result.skipped == [
        {"item": "img3", "reason": "no features"},
        {"item": "img4", "reason": "no reference caption"},
    ]


def test_metrics_have_the_flat_keys(result):
    keys = {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor", "rouge_l", "cider"}
    assert keys <= set(result.metrics)
    # scores only: a count would be one more column of every `dvc metrics show` and `exp show`
    assert not {"images", "pointing_words"} & set(result.metrics)


def test_pointing_accuracy_from_boxes_that_always_or_never_hit(result):
    # every 'circle' in img0/img1 hits (box covers the crop), none in img2 (its box holds no
    # cell centre: centres are at 8, 24, 40, 56 and the box spans 9..23)
    circles = [sum(w == "circle" for w in c.words) for c in result.captions]
    assert result.grounding.total == sum(circles)
    assert result.grounding.hits == circles[0] + circles[1]
    if sum(circles):
        assert result.metrics["pointing_accuracy"] == pytest.approx(
            (circles[0] + circles[1]) / sum(circles)
        )


def test_captions_that_equal_their_references_score_bleu_and_rouge_one(data, result, tmp_path):
    root, model_dir = data
    # references replaced by the captions the model produces: precision and recall are 1
    write_references(root / "echo.parquet", {c.image_id: [c.text] for c in result.captions})
    echo = _evaluate(root, model_dir, captions="echo.parquet", metrics=("bleu", "rouge"))
    for key in ("bleu_1", "bleu_4", "rouge_l"):
        assert echo.metrics[key] == pytest.approx(1.0, abs=1e-6)


def test_batch_size_does_not_change_the_captions(data, result):
    root, model_dir = data
    from sat_model.model.checkpoint import load_model

    model, vocab, _ = load_model(model_dir)
    store = FeatureStore(root / "test.arrow")
    one = decode_split(
        model, vocab, store, ["img0", "img1", "img2"], Decoding(2, MAX_LEN, batch_size=1)
    )
    assert [c.words for c in one] == [c.words for c in result.captions]


def test_nothing_to_evaluate_is_an_error(data, tmp_path):
    root, model_dir = data
    write_references(tmp_path / "other.parquet", {"elsewhere": ["a circle"]})
    with pytest.raises(EvaluationError, match="no 'test' image has both"):
        evaluate_model(
            model_dir,
            _split(root, tmp_path / "other.parquet"),
            EvalConfig(beam_size=1, max_length=2),
            EncoderConfig(resize=CROP),
        )


def test_reports_are_json_with_flat_metrics(result, tmp_path):
    write_reports(result, tmp_path, "test")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert all(isinstance(v, float | int) for v in metrics.values())
    captions = json.loads((tmp_path / "captions.json").read_text())
    assert [c["image_id"] for c in captions["captions"]] == ["img0", "img1", "img2"]
    assert captions["skipped"][0]["reason"] == "no features"
    assert read_metrics(tmp_path) == metrics  # the reader of the reports folder's owner
    assert read_metrics(tmp_path / "never-evaluated") is None


def test_gallery_has_one_figure_per_image_and_skips_missing_photos(data, result, tmp_path):
    root, _ = data
    records = read_image_records(root / "images.parquet", "test", root / "images")
    records.pop("img1")  # as if the image table lost it
    page, skipped = write_attention_gallery(
        result.captions,
        records,
        tmp_path,
        count=3,
        view=FeatureView(GRID, GRID, CROP, CROP),
        title="soft",
        scored=result,
    )
    assert skipped == [{"item": "img1", "reason": "not in the image table"}]
    assert not list(tmp_path.glob("*.png"))  # the PNGs have a folder of their own (DVC plots)
    # numbered in image id order, whatever the ids: names a dvc.yaml plot can list
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["000.png", "001.png"]
    index = read_index(tmp_path)
    assert index.images == ["images/000.png", "images/001.png"]
    assert index.headings == ["img0", "img2"]
    shown = {c.image_id: c for c in result.captions}
    assert index.captions == [shown["img0"].text, shown["img2"].text]
    assert index.references == [result.references["img0"], result.references["img2"]]
    for image_id, line in zip(index.headings, index.scores, strict=True):
        # each image's own scores: BLEU-4 and ROUGE-L of it scored alone (CIDEr needs them all)
        hypothesis, references = shown[image_id].text, result.references[image_id]
        alone = score_captions({"x": hypothesis}, {"x": references}, ["bleu", "rouge"])
        assert line.startswith(f"bleu_4 {alone['bleu_4']:.3f} · rouge_l {alone['rouge_l']:.3f}")
        assert "cider" in line
    for src, image_id in zip(index.images, index.headings, strict=True):
        panels = figure_panels(tmp_path / src)
        assert sum(map(len, panels)) == len(shown[image_id].words) + 1  # the photo, then words
        assert [len(row) for row in panels] == [5, 1]  # MAX_LEN words + photo, 5 a row
    assert page == tmp_path / "index.html"
