"""``python -m pipeline.stages.prepare``: params in, the four promised files out."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.stages.prepare import main

IMAGE_COLUMNS = ["image_id", "split", "file", "width", "height", "status", "boxes"]
CAPTION_COLUMNS = ["image_id", "split", "file", "caption_index", "raw", "tokens"]
REPORT_KEYS = {
    "images_total",
    "images_ok",
    "images_skipped",
    "captions_total",
    "captions_kept",
    "captions_skipped",
    "vocab_size",
    "images_train",
    "images_val",
    "images_test",
    "skipped",
}

TINY = """\
data:
  source: synthetic
  prepared_dir: out/prepared
  synthetic:
    seed: 1
    train_images: 12
    val_images: 4
    test_images: 4
  vocab:
    min_count: 1
"""


def test_main_writes_all_four_files_with_the_promised_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "params.yaml").write_text(TINY)
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the working directory
    assert main(["--params", "params.yaml"]) == 0
    out = tmp_path / "out/prepared"
    images = pq.read_table(out / "images.parquet")
    captions = pq.read_table(out / "captions.parquet")
    assert images.column_names == IMAGE_COLUMNS
    assert captions.column_names == CAPTION_COLUMNS
    assert images.schema.metadata[b"source"] == b"synthetic"
    assert images.schema.metadata[b"image_root"] == b"images"  # relative to the table's folder
    report = json.loads((out / "prepare_report.json").read_text())
    assert set(report) == REPORT_KEYS
    assert (report["images_train"], report["images_val"], report["images_test"]) == (12, 4, 4)
    assert report["captions_kept"] == 20 * 5 == captions.num_rows
    vocab = json.loads((out / "vocab.json").read_text())
    assert vocab["itos"][:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert len(vocab["itos"]) == report["vocab_size"]
    assert len(list((out / "images").glob("*.png"))) == 20
    # one line: what it did, where (relative to the project), how long
    (line,) = capsys.readouterr().out.splitlines()
    what = f"20 images (train 12, val 4, test 4), 100 captions, {report['vocab_size']} words"
    assert line.startswith(f"prepare: {what} -> out/prepared (")


def test_main_applies_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "params.yaml").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    assert main(["--params", "params.yaml", "-S", "data.synthetic.val_images=2"]) == 0
    report = json.loads((tmp_path / "out/prepared/prepare_report.json").read_text())
    assert report["images_val"] == 2


def test_main_rejects_an_unknown_key_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "params.yaml").write_text(TINY + "  colour_depth: 8\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["--params", "params.yaml"])
    assert exited.value.code == 1
    assert "data.colour_depth" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_main_reports_an_unusable_dataset_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "params.yaml").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    # every file in place, but no photo in any list
    root = tmp_path / "flickr"
    (root / "Flickr8k_text").mkdir(parents=True)
    (root / "Flickr8k_Dataset").mkdir()
    for split in ("train", "dev", "test"):
        (root / "Flickr8k_text" / f"Flickr_8k.{split}Images.txt").write_text("")
    (root / "Flickr8k_text" / "Flickr8k.token.txt").write_text("")
    code = main(
        ["--params", "params.yaml", "-S", "data.source=flickr8k", "-S", f"data.root={root}"]
    )
    assert code == 1
    assert "have no usable image" in capsys.readouterr().err
