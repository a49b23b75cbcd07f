"""Extraction from a prepared image table into feature stores (random encoder, tiny PNGs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from sat_model.config import EncoderConfig
from sat_model.features.encoders import build_encoder
from sat_model.features.extract import ExtractError, extract_features, read_image_table
from sat_model.features.images import load_image, preprocess
from sat_model.features.store import FeatureStore
from sat_model.paths import shared_data

RESIZE, CROP = 36, 32

# (image_id, split, status, how the file is written)
ROWS = [
    ("a", "train", "ok", "png"),
    ("b", "train", "ok", "corrupt"),
    ("c", "train", "ok", "png"),
    ("d", "train", "caption missing", "png"),  # not ok in prepare: never extracted
    ("e", "val", "ok", "png"),
    ("f", None, "ok", "png"),  # in no split
    ("g", "train", "ok", "png"),
]


def write_image_table(root: Path, rows=ROWS, with_root: bool = True) -> Path:
    images = root / "images"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for image_id, _, _, kind in rows:
        path = images / f"{image_id}.png"
        if kind == "corrupt":
            path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
        else:
            size = (int(rng.integers(40, 60)), int(rng.integers(40, 60)))
            pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)
    table = pa.table(
        {
            "image_id": [r[0] for r in rows],
            "split": [r[1] for r in rows],
            "file": [f"images/{r[0]}.png" for r in rows],
            "width": pa.array([50] * len(rows), pa.int32()),
            "height": pa.array([50] * len(rows), pa.int32()),
            "status": [r[2] for r in rows],
        }
    )
    if with_root:
        table = table.replace_schema_metadata({"image_root": str(root), "source": "synthetic"})
    path = root / "images.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def encoder():
    return build_encoder("random", input_size=CROP)


def _extract(table: Path, out: Path, encoder, num_workers: int = 0, batch_size: int = 2, **kwargs):
    settings = EncoderConfig(
        resize=RESIZE,
        crop=CROP,
        batch_size=batch_size,
        num_workers=num_workers,
        max_image_pixels=10_000,
        **kwargs,
    )
    return extract_features(table, table.parent, out, encoder, settings, progress=False)


def test_table_reader_keeps_ok_rows_in_a_split_in_table_order(tmp_path: Path) -> None:
    items = read_image_table(write_image_table(tmp_path), tmp_path)
    assert list(items) == ["train", "val"]
    assert [i.image_id for i in items["train"]] == ["a", "b", "c", "g"]
    assert items["val"][0].path == str(tmp_path / "images" / "e.png")


def test_corrupt_image_is_skipped_with_reason_and_others_extracted(tmp_path, encoder) -> None:
    report = _extract(write_image_table(tmp_path), tmp_path / "features", encoder)
    train = FeatureStore(tmp_path / "features" / "train.arrow")
    assert train.ids == ["a", "c", "g"]
    assert FeatureStore(tmp_path / "features" / "val.arrow").ids == ["e"]
    out = report.to_dict()
    assert (out["images_extracted"], out["images_skipped"]) == (4, 1)
    assert (out["extracted_train"], out["skipped_train"], out["extracted_val"]) == (3, 1, 1)
    assert out["skipped"][0]["item"] == "b" and "cannot decode" in out["skipped"][0]["reason"]


def test_stored_features_equal_encoding_each_image_alone(tmp_path, encoder) -> None:
    _extract(write_image_table(tmp_path), tmp_path / "features", encoder)
    store = FeatureStore(tmp_path / "features" / "train.arrow")
    assert store.spec.L == 4 and store.spec.D == 32  # 32 px / 16 → 2×2 grid
    d = encoder.spec
    image = load_image(tmp_path / "images" / "c.png")
    x = preprocess(image, RESIZE, CROP, d.mean, d.std)[None]  # (1, 3, S, S)
    with torch.inference_mode():
        expected = encoder(x)[0].numpy()  # (L, D)
    np.testing.assert_allclose(store[store.index_of("c")], expected, rtol=2e-3, atol=2e-3)


def test_a_mirrored_split_holds_the_features_of_its_photos_mirrored(tmp_path, encoder) -> None:
    report = _extract(
        write_image_table(tmp_path), tmp_path / "features", encoder, mirror_train=True
    ).to_dict()
    train = FeatureStore(tmp_path / "features" / "train.arrow")
    mirrored = FeatureStore(tmp_path / "features" / "train_mirrored.arrow")
    assert mirrored.ids == train.ids == ["a", "c", "g"]  # b is corrupt in both
    assert not (tmp_path / "features" / "val_mirrored.arrow").exists()
    assert (report["extracted_train_mirrored"], report["skipped_train_mirrored"]) == (3, 1)
    d = encoder.spec
    x = preprocess(load_image(tmp_path / "images" / "c.png"), RESIZE, CROP, d.mean, d.std)
    with torch.inference_mode():
        expected = encoder(x.flip(-1)[None])[0].numpy()  # (L, D) of the mirrored crop
    np.testing.assert_allclose(mirrored[mirrored.index_of("c")], expected, rtol=2e-3, atol=2e-3)
    assert np.abs(mirrored[1] - train[1]).max() > 0.1  # not the photo as it is


def test_worker_processes_write_byte_identical_stores(tmp_path, encoder) -> None:
    table = write_image_table(tmp_path)
    _extract(table, tmp_path / "serial", encoder, num_workers=0)
    _extract(table, tmp_path / "workers", encoder, num_workers=2)
    for split in ("train", "val"):
        serial = (tmp_path / "serial" / f"{split}.arrow").read_bytes()
        assert serial == (tmp_path / "workers" / f"{split}.arrow").read_bytes()


def test_oversized_image_is_skipped_by_the_pixel_limit(tmp_path, encoder) -> None:
    rows = [("a", "train", "ok", "png"), ("big", "train", "ok", "png")]
    table = write_image_table(tmp_path, rows)
    Image.new("RGB", (200, 200)).save(tmp_path / "images" / "big.png")  # 40,000 > 10,000
    report = _extract(table, tmp_path / "features", encoder).to_dict()
    assert report["extracted_train"] == 1
    assert "decompression bomb" in report["skipped"][0]["reason"]


def test_nothing_extractable_fails_loudly(tmp_path, encoder) -> None:
    table = write_image_table(tmp_path, [("b", "train", "ok", "corrupt")])
    with pytest.raises(ExtractError, match="no image could be extracted"):
        _extract(table, tmp_path / "features", encoder)


def test_table_without_image_root_metadata_reads_from_the_root_given(tmp_path, encoder) -> None:
    table = write_image_table(tmp_path, with_root=False)
    report = _extract(table, tmp_path / "features", encoder)
    assert report.splits[0].extracted == 3  # a, c, g of train (b is corrupt)


def test_crop_must_match_the_encoder_input_size(tmp_path, encoder) -> None:
    table = write_image_table(tmp_path)
    with pytest.raises(ValueError, match="crop 48 != encoder input size 32"):
        settings = EncoderConfig(resize=64, crop=48, batch_size=2, num_workers=0)
        extract_features(table, tmp_path, tmp_path / "f", encoder, settings, progress=False)


SAMPLE = shared_data("flickr8k-sample")


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="Flickr8k sample absent (../shared/data)")
def test_parallel_workers_give_the_sequential_features_on_real_jpegs(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "photos"
    root.mkdir()
    names = sorted(p.name for p in (SAMPLE / "Flickr8k_Dataset").glob("*.jpg"))[:10]
    for name in names:  # a copy in tmp_path: the shared data stays read-only
        shutil.copy(SAMPLE / "Flickr8k_Dataset" / name, root / name)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)  # JPEG magic only
    files = [*names[:5], "broken.jpg", "none.jpg", *names[5:]]
    ids = [*names[:5], "broken", "missing", *names[5:]]
    table = pa.table(
        {"image_id": ids, "split": ["train"] * len(ids), "file": files, "status": ["ok"] * len(ids)}
    )
    pq.write_table(table, tmp_path / "images.parquet")
    encoder = build_encoder("random", input_size=224)
    reports = {}
    for workers in (0, 2):
        reports[workers] = extract_features(
            tmp_path / "images.parquet",
            root,
            tmp_path / f"w{workers}",
            encoder,
            EncoderConfig(resize=256, crop=224, batch_size=4, num_workers=workers),
            progress=False,
        ).to_dict()
    sequential = FeatureStore(tmp_path / "w0" / "train.arrow")
    parallel = FeatureStore(tmp_path / "w2" / "train.arrow")
    assert parallel.ids == sequential.ids == names
    rows = np.arange(len(names))
    np.testing.assert_array_equal(parallel.get_batch(rows), sequential.get_batch(rows))
    # the store holds what the one-image path (``preprocess``, as ``sat caption`` uses) gives
    d = encoder.spec
    first = preprocess(load_image(root / names[0], min_side=256), 256, 224, d.mean, d.std)
    with torch.inference_mode():
        expected = encoder(first.unsqueeze(0)).to(torch.float16).numpy()  # (1, L, D)
    np.testing.assert_array_equal(parallel.get_batch([0]), expected)
    for report in reports.values():
        reasons = {s["item"]: s["reason"] for s in report["skipped"]}
        assert reasons["missing"] == "file not found"
        assert reasons["broken"].startswith("cannot decode")
