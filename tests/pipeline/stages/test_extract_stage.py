"""The ``extract`` stage entry point, local and Ray engines, on a tiny prepared table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.stages.extract import main
from sat_model.features.store import FeatureStore

ROWS = [  # (image_id, split, kind)
    ("t0", "train", "png"),
    ("t1", "train", "jpg"),
    ("bad", "train", "corrupt"),
    ("t2", "train", "png"),
    ("t3", "train", "png"),
    ("v0", "val", "png"),
    ("v1", "val", "png"),
]


def _project(root: Path, encoder: str, crop: int, resize: int) -> Path:
    """A project folder with params.yaml and data/prepared/images.parquet (contract schema)."""
    prepared = root / "data" / "prepared"
    (prepared / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = []
    for image_id, _, kind in ROWS:
        path = prepared / "images" / f"{image_id}.{'jpg' if kind == 'jpg' else 'png'}"
        if kind == "corrupt":
            path.write_bytes(b"GIF89a" + bytes(20))
        else:
            pixels = rng.integers(0, 255, (int(rng.integers(70, 90)), 80, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)
        files.append(path.name)  # relative to <prepared_dir>/images, the synthetic image root
    table = pa.table(
        {
            "image_id": [r[0] for r in ROWS],
            "split": [r[1] for r in ROWS],
            "file": files,
            "width": pa.array([80] * len(ROWS), pa.int32()),
            "height": pa.array([80] * len(ROWS), pa.int32()),
            "status": ["ok"] * len(ROWS),
        }
    ).replace_schema_metadata({"image_root": str(prepared / "images"), "source": "synthetic"})
    pq.write_table(table, prepared / "images.parquet")
    params = {
        "encoder": {
            "name": encoder,
            "resize": resize,
            "crop": crop,
            "batch_size": 2,
            "num_workers": 0,
            "torch_threads": 1,
        },
    }
    (root / "params.yaml").write_text(json.dumps(params))  # JSON is YAML
    return root


def test_local_stage_writes_stores_and_report(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(_project(tmp_path, "random", 32, 40))
    assert main(["-S", "encoder.num_workers=1"]) == 0
    features = tmp_path / "data" / "features"
    assert sorted(p.name for p in features.iterdir()) == [
        "extract_report.json",
        "train.arrow",
        "val.arrow",
    ]
    assert FeatureStore(features / "train.arrow").ids == ["t0", "t1", "t2", "t3"]
    report = json.loads((features / "extract_report.json").read_text())
    assert (report["images_extracted"], report["images_skipped"]) == (6, 1)
    assert (report["extracted_train"], report["extracted_val"]) == (4, 2)
    assert report["skipped"][0]["item"] == "bad" and report["skipped"][0]["reason"]
    assert report["encoder"]["weights_sha256"] == "random-seed-0"
    # the run's engine and speed sit apart, so the features' hash is the same on a re-run
    assert not {"engine", "seconds", "images_per_s"} & report.keys()
    timing = json.loads((tmp_path / "reports" / "extract_timing.json").read_text())
    assert (timing["engine"], timing["images_extracted"]) == ("local", 6)
    assert timing["seconds"] > 0 and timing["images_per_s"] > 0
    first = (features / "extract_report.json").read_bytes()
    assert main(["-S", "encoder.num_workers=0"]) == 0  # another run, another speed
    assert (features / "extract_report.json").read_bytes() == first


def test_mirror_train_also_writes_the_mirrored_train_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(_project(tmp_path, "random", 32, 40))
    assert main(["-S", "encoder.mirror_train=true"]) == 0
    features = tmp_path / "data" / "features"
    assert FeatureStore(features / "train_mirrored.arrow").ids == ["t0", "t1", "t2", "t3"]
    assert not (features / "val_mirrored.arrow").exists()
    report = json.loads((features / "extract_report.json").read_text())
    assert (report["extracted_train_mirrored"], report["images_extracted"]) == (4, 10)
    train = FeatureStore(features / "train.arrow").get_batch([0, 1, 2, 3])
    assert not np.array_equal(
        FeatureStore(features / "train_mirrored.arrow").get_batch([0, 1, 2, 3]), train
    )


def test_stage_rejects_an_unknown_param_before_any_work(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(_project(tmp_path, "random", 32, 40))
    with pytest.raises(SystemExit) as exited:  # one line on stderr, no traceback
        main(["-S", "encoder.colour=1"])
    assert exited.value.code == 1
    assert "encoder.colour" in capsys.readouterr().err
    assert not (tmp_path / "data" / "features").exists()


def test_photos_missing_is_one_short_line_naming_the_reason(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A photo folder moved after ``prepare`` (or ``data.root`` pointing elsewhere): every
    image is skipped, the stage fails with one line that counts the reasons and names a few
    images, not a traceback holding the whole skipped list."""
    project = _project(tmp_path, "random", 32, 40)
    monkeypatch.chdir(project)
    images = project / "data" / "prepared" / "images"
    images.rename(project / "data" / "prepared" / "moved")
    assert main([]) == 1
    err = capsys.readouterr().err.rsplit("\n", 2)[-2] + "\n"  # the line after the progress bars
    assert err.startswith("extract: error: no image could be extracted")
    summary = "7 of 7 images skipped: file not found (7); first: train/t0, train/t1, train/bad, ..."
    assert summary in err
    assert str(images) in err  # where the photos were looked for
    assert len(err) < 600
    assert not (project / "data" / "features" / "extract_report.json").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_engine_writes_byte_identical_stores(tmp_path: Path, monkeypatch, ray_local) -> None:
    monkeypatch.chdir(_project(tmp_path, "efficientnet_lite0", 64, 72))
    mirror = ["-S", "encoder.mirror_train=true"]  # the mirrored train photos go through Ray too
    assert main(["-S", "encoder.features_dir=local", *mirror]) == 0
    assert main(["-S", "encoder.features_dir=viaray", "-S", "encoder.engine=ray", *mirror]) == 0
    timing = json.loads((tmp_path / "reports" / "extract_timing.json").read_text())
    assert timing["engine"] == "ray"
    for split in ("train", "val", "train_mirrored"):
        local = (tmp_path / "local" / f"{split}.arrow").read_bytes()
        assert local == (tmp_path / "viaray" / f"{split}.arrow").read_bytes()
    local_report = json.loads((tmp_path / "local" / "extract_report.json").read_text())
    ray_report = json.loads((tmp_path / "viaray" / "extract_report.json").read_text())
    assert ray_report == local_report  # the engine changes no byte of the features' folder
    assert ray_local.is_initialized()  # the shared session cluster is left running
