"""The ``data/prepared`` contract: its file names, table schemas and readers (one owner).

``prepare`` writes these files; ``extract``, ``train``, ``evaluate`` and the pipeline read them
only through this module, so a column or a file name changes in one place
(docs/ARCHITECTURE.md, "Data contracts").

- ``images.parquet`` (:data:`IMAGES_SCHEMA`): one row per source image, ``status`` ``"ok"`` or
  why it is unusable; ``file`` is relative to the image root, which comes from params alone
  (:func:`sat_model.data.sources.image_root`): the table's own ``image_root`` metadata is only a record
  of where prepare read (relative to the table's folder, so the table is the same bytes in every
  checkout), never trusted, so editing the table cannot open other files.
- ``captions.parquet`` (:data:`CAPTIONS_SCHEMA`): the kept captions, raw and tokenised.
- ``vocab.json`` (:mod:`sat_model.data.vocab`) and ``prepare_report.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sat_model.paths import resolve_inside

__all__ = [
    "BOX_TYPE",
    "CAPTIONS_FILE",
    "CAPTIONS_SCHEMA",
    "IMAGES_FILE",
    "IMAGES_SCHEMA",
    "REPORT_FILE",
    "SPLITS",
    "VOCAB_FILE",
    "Box",
    "ImageRecord",
    "TableError",
    "load_references",
    "read_caption_rows",
    "read_images",
    "split_order",
]

IMAGES_FILE = "images.parquet"
CAPTIONS_FILE = "captions.parquet"
VOCAB_FILE = "vocab.json"
REPORT_FILE = "prepare_report.json"
SPLITS = ("train", "val", "test")


class TableError(ValueError):
    """A prepared table cannot be read; the message names the file."""


@dataclass(frozen=True)
class Box:
    """An object's axis-aligned pixel box (``x0 <= x1``, ``y0 <= y1``) and what it is.

    Synthetic scenes record one per object in ``images.parquet``; grounding maps words onto
    them. ``label`` is the object's name ("large red circle"), ``shape``/``colour``/``size`` its
    parts ("" where unknown).
    """

    x0: float
    y0: float
    x1: float
    y1: float
    label: str = ""
    shape: str = ""
    colour: str = ""
    size: str = ""

    def contains(self, x: float, y: float) -> bool:
        return self.x0 <= x <= self.x1 and self.y0 <= y <= self.y1

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2

    @classmethod
    def from_row(cls, cell: dict[str, Any]) -> Box:
        """A box from one entry of an ``images.parquet`` ``boxes`` cell."""
        return cls(**{f.name: cell[f.name] for f in fields(cls)})


BOX_TYPE = pa.struct(
    [("label", pa.string()), ("shape", pa.string()), ("colour", pa.string()), ("size", pa.string())]
    + [(k, pa.float32()) for k in ("x0", "y0", "x1", "y1")]
)
IMAGES_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),
        ("split", pa.string()),
        ("file", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("status", pa.string()),
        ("boxes", pa.list_(BOX_TYPE)),
    ]
)
CAPTIONS_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),
        ("split", pa.string()),
        ("file", pa.string()),
        ("caption_index", pa.int32()),
        ("raw", pa.string()),
        ("tokens", pa.list_(pa.string())),
    ]
)


@dataclass(frozen=True)
class ImageRecord:
    """A usable image of ``images.parquet``: where the photo is, its split, size and boxes."""

    image_id: str
    split: str
    path: Path  # absolute: Ray workers do not share the driver's working directory
    width: int | None  # None only in a hand-made table without sizes (grounding needs them)
    height: int | None
    boxes: tuple[Box, ...]
    refused: str = ""  # why the photo is never opened (its path leaves the image root), or ""


def split_order(split: str) -> tuple[int, str]:
    """Sort key: train, val, test, then any other split by name."""
    return (SPLITS.index(split) if split in SPLITS else len(SPLITS), split)


def read_images(
    path: str | Path, image_root: str | Path | None, split: str | None = None
) -> list[ImageRecord]:
    """The images with ``status == "ok"`` and a split (only ``split``'s, if given), in table order.

    Names resolve under ``image_root`` (from params); a name that leaves it ("../x.jpg", an
    absolute path, a symbolic link out of the root) is never opened: the record carries the
    reason in ``refused``. Without ``image_root`` every record is refused for opening (sizes and
    boxes are still read).

    Raises:
        TableError: the file is missing or not an images table.
    """
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise TableError(f"cannot read image table {path}: {e}") from e
    missing = [c for c in ("image_id", "split", "file", "status") if c not in table.column_names]
    if missing:
        raise TableError(f"image table {path} lacks columns {missing}")
    root = None if image_root is None else Path(image_root).resolve()
    records = []
    for row in table.to_pylist():
        if row["status"] != "ok" or row["split"] is None:
            continue
        if split is not None and row["split"] != split:
            continue
        if root is None:
            file, refused = Path(row["file"]), "no image root given"
        else:
            file, refused = resolve_inside(root, row["file"])
        boxes = tuple(Box.from_row(b) for b in row.get("boxes") or ())
        width, height = row.get("width"), row.get("height")
        records.append(
            ImageRecord(row["image_id"], row["split"], file, width, height, boxes, refused)
        )
    return records


def read_caption_rows(path: str | Path, split: str, columns: list[str]) -> dict[str, list[Any]]:
    """``columns`` of the ``split`` rows of ``captions.parquet``, in table order."""
    try:
        table = pq.read_table(path, columns=sorted({"split", *columns}))
    except (OSError, ValueError, KeyError) as e:
        raise TableError(f"cannot read caption table {path}: {e}") from e
    rows = table.filter(pc.equal(table["split"], split)).to_pydict()
    return {c: rows[c] for c in columns}


def load_references(captions_path: str | Path, split: str) -> dict[str, list[str]]:
    """Raw reference captions per image id of ``split``, in caption order (for scoring)."""
    rows = read_caption_rows(captions_path, split, ["image_id", "caption_index", "raw"])
    order = sorted(zip(rows["image_id"], rows["caption_index"], rows["raw"], strict=True))
    refs: dict[str, list[str]] = {}
    for image_id, _, raw in order:
        refs.setdefault(image_id, []).append(raw)
    return refs
