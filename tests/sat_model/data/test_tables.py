"""The data/prepared contract's one owner: readers, the image-root rule, boxes, clear errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sat_model.data.tables import Box, TableError, load_references, read_images
from tests.factories import write_captions

BOX = dict(label="small red star", shape="star", colour="red", size="small")


def _images_table(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(image_id: str, split: str | None, file: str, status: str = "ok", boxes=()) -> dict:
    return dict(
        image_id=image_id,
        split=split,
        file=file,
        width=40,
        height=30,
        status=status,
        boxes=list(boxes),
    )


def test_only_usable_rows_of_the_split_are_read_in_table_order(tmp_path: Path) -> None:
    table = _images_table(
        tmp_path / "images.parquet",
        [
            _row("b", "test", "b.png"),
            _row("a", "test", "a.png"),
            _row("c", "test", "c.png", status="corrupt or truncated image"),
            _row("d", None, "d.png"),
            _row("e", "train", "e.png"),
        ],
    )
    records = read_images(table, tmp_path / "root", split="test")
    assert [r.image_id for r in records] == ["b", "a"]
    assert records[0].path == (tmp_path / "root" / "b.png").resolve()
    assert (records[0].width, records[0].height, records[0].refused) == (40, 30, "")
    assert [r.split for r in read_images(table, tmp_path / "root")] == ["test", "test", "train"]


def test_a_name_leaving_the_root_is_refused_not_opened(tmp_path: Path) -> None:
    table = _images_table(
        tmp_path / "images.parquet",
        [_row("up", "test", "../secret.png"), _row("abs", "test", "/etc/passwd")],
    )
    for record in read_images(table, tmp_path / "root"):
        assert "escapes the image root" in record.refused, record


def test_without_a_root_every_record_is_refused_but_boxes_are_read(tmp_path: Path) -> None:
    box = dict(BOX, x0=1.0, y0=2.0, x1=3.0, y1=4.0)
    table = _images_table(tmp_path / "images.parquet", [_row("a", "test", "a.png", boxes=[box])])
    (record,) = read_images(table, None)
    assert record.refused == "no image root given"
    assert record.boxes == (Box(1.0, 2.0, 3.0, 4.0, **BOX),)
    assert record.boxes[0].centre == (2.0, 3.0) and record.boxes[0].contains(1.0, 4.0)


def test_unreadable_or_wrong_tables_raise_a_table_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(TableError, match=r"missing\.parquet"):
        read_images(tmp_path / "missing.parquet", tmp_path)
    wrong = _images_table(tmp_path / "wrong.parquet", [{"image_id": "a", "split": "test"}])
    with pytest.raises(TableError, match=r"wrong\.parquet lacks columns \['file', 'status'\]"):
        read_images(wrong, tmp_path)
    with pytest.raises(TableError, match=r"missing\.parquet"):
        load_references(tmp_path / "missing.parquet", "test")


def test_references_are_grouped_per_image_in_caption_order(tmp_path: Path) -> None:
    path = write_captions(
        tmp_path / "captions.parquet",
        [("x", "val", 2, "third"), ("x", "val", 0, "first"), ("y", "test", 0, "other split")],
    )
    assert load_references(path, "val") == {"x": ["first", "third"]}
