"""The image root comes from params: editing ``images.parquet``'s ``image_root`` changes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sat_model.config import EncoderConfig
from sat_model.config import DataConfig
from sat_model.data.sources.synthetic import SyntheticConfig
from sat_model.data.sources import read_source
from sat_model.evaluation.evaluate import (
    DecodedCaption,
    read_image_records,
    FeatureView,
    write_attention_gallery,
)
from sat_model.evaluation.visualize import FIGURES_DIR
from sat_model.features.encoders import build_encoder
from sat_model.features.extract import extract_features, read_image_table
from sat_model.data.sources import image_root
from sat_model.paths import shared_data
from tests.factories import ROOT

SAMPLE = shared_data("flickr8k-sample")


@pytest.fixture
def tampered(tmp_path: Path) -> Path:
    """A prepared table whose metadata was edited to ``/``, with rows naming files outside the
    real image root: ``etc/passwd`` and a real photo one folder up."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 40), (200, 10, 10)).save(tmp_path / "images" / "inside.png")
    Image.new("RGB", (40, 40), (10, 200, 10)).save(tmp_path / "secret.png")
    files = {
        "inside": "inside.png",
        "passwd": "etc/passwd",
        "secret": str(tmp_path)[1:] + "/secret.png",
    }
    table = pa.table(
        {
            "image_id": list(files),
            "split": ["test"] * len(files),
            "file": list(files.values()),
            "width": pa.array([40] * len(files), pa.int32()),
            "height": pa.array([40] * len(files), pa.int32()),
            "status": ["ok"] * len(files),
        }
    ).replace_schema_metadata({"image_root": "/", "source": "flickr8k"})
    pq.write_table(table, tmp_path / "images.parquet")
    return tmp_path / "images.parquet"


def test_extract_reads_under_the_root_given_not_the_tables(tampered: Path) -> None:
    (items,) = read_image_table(tampered, tampered.parent / "images").values()
    paths = {i.image_id: Path(i.path) for i in items}
    assert all(p.is_relative_to(tampered.parent / "images") for p in paths.values())
    encoder = build_encoder("random", input_size=32)
    report = extract_features(
        tampered,
        tampered.parent / "images",
        tampered.parent / "features",
        encoder,
        EncoderConfig(resize=40, crop=32, batch_size=2, num_workers=0, max_image_pixels=10_000),
        progress=False,
    )
    (split,) = report.splits
    assert split.extracted == 1  # only inside.png; /etc/passwd and ../secret.png never opened
    assert sorted(image_id for image_id, _ in split.skipped) == ["passwd", "secret"]


def test_gallery_opens_photos_only_under_the_root_given(tampered: Path, tmp_path: Path) -> None:
    records = read_image_records(tampered, "test", tampered.parent / "images")
    alphas = np.full((1, 4), 0.25)  # (len, L): a 2x2 grid, uniform attention
    captions = [DecodedCaption(i, ("circle",), alphas, -1.0) for i in sorted(records)]
    _, skipped = write_attention_gallery(
        captions,
        records,
        tmp_path / "gallery",
        count=3,
        view=FeatureView(2, 2, 40, 32),
        title="t",
    )
    assert sorted(s["item"] for s in skipped) == ["passwd", "secret"]
    assert len(list((tmp_path / "gallery" / FIGURES_DIR).glob("*.png"))) == 1  # one figure


def test_without_a_root_no_photo_is_opened_but_sizes_are_kept(tampered: Path) -> None:
    records = read_image_records(tampered, "test")
    assert all(r.refused == "no image root given" for r in records.values())
    assert {r.width for r in records.values()} == {40}


def test_the_params_root_is_the_one_prepare_reads_synthetic(tmp_path: Path) -> None:
    sizes = SyntheticConfig(train_images=1, val_images=1, test_images=1, image_size=64)
    data = DataConfig(source="synthetic", prepared_dir="out", synthetic=sizes)
    src = read_source(data, tmp_path / "out", tmp_path)
    assert image_root(data, tmp_path) == src.image_root


@pytest.mark.skipif(not (SAMPLE / "dataset_flickr8k.json").is_file(), reason=f"no {SAMPLE}")
@pytest.mark.parametrize("source", ["flickr8k", "karpathy"])
def test_the_params_root_is_the_one_prepare_reads_flickr8k(source: str) -> None:
    data = DataConfig(source=source, root=str(SAMPLE), required_splits=("train", "val"))
    assert image_root(data, Path.cwd()) == read_source(data, SAMPLE, Path.cwd()).image_root


def test_shared_data_is_beside_the_repository_unless_the_variable_names_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sat_model.paths import SHARED_DATA_ENV

    monkeypatch.delenv(SHARED_DATA_ENV, raising=False)
    repo = ROOT
    assert shared_data("flickr8k-sample") == repo.parent / "shared" / "data" / "flickr8k-sample"
    monkeypatch.setenv(SHARED_DATA_ENV, str(tmp_path))
    assert shared_data("flickr8k-sample") == tmp_path / "flickr8k-sample"
    assert shared_data() == tmp_path
