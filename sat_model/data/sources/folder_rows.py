"""The rows of a folder source's captions file (CSV or JSON lines) and their screening:
malformed, duplicate and contradicting rows are skipped with a reason, the others kept."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sat_model.data.sources.records import Skip, SourceError, leaves_folder, lines, read_bytes

__all__ = ["Row", "csv_rows", "jsonl_rows", "screen_rows"]


# ------------------------------------------------------------------------------- folder
@dataclass(frozen=True)
class Row:
    item: str  # "captions.csv line 12"
    file: str
    caption: str
    split: str | None


def csv_rows(path: Path, name: str) -> tuple[list[Row | Skip], bool]:
    """The rows of a CSV captions file and whether it has a split column."""
    try:
        text = read_bytes(path, "captions file").decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SourceError(f"captions file {path} is not UTF-8: {e}") from e
    reader = csv.DictReader(io.StringIO(text, newline=""))
    # a spreadsheet's "File" or " caption" header names the same column
    columns = [c.strip().lower() for c in reader.fieldnames or []]
    reader.fieldnames = columns
    missing = [c for c in ("file", "caption") if c not in columns]
    if missing:
        raise SourceError(
            f"captions file {path} has no column {' or '.join(missing)} (its header: {columns}; "
            "expected file, caption and optionally split)"
        )
    rows: list[Row | Skip] = []
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # a field over csv's size limit, say: that line, not the file
            rows.append(
                Skip(f"{name} after line {reader.line_num}", f"malformed line: {e}", "caption")
            )
            continue
        item = f"{name} line {reader.line_num}"
        if record.get(None):  # DictReader: the fields beyond the header
            reason = f"malformed line: more fields than the header's {len(columns)} (a comma in "
            rows.append(Skip(item, reason + "a caption needs quotes)", "caption"))
            continue
        split = record.get("split") if "split" in columns else None
        rows.append(Row(item, record["file"] or "", record["caption"] or "", split))
    return rows, "split" in columns


def jsonl_rows(path: Path, name: str) -> tuple[list[Row | Skip], bool]:
    """The rows of a JSON-lines captions file (one object a line) and whether one has a split."""
    rows: list[Row | Skip] = []
    has_split = False
    for n, line in lines(path, "captions file"):
        item = f"{name} line {n}"
        try:
            record = json.loads(line) if line is not None else None
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            rows.append(Skip(item, "malformed line: expected a JSON object", "caption"))
            continue
        file, caption, split = record.get("file"), record.get("caption"), record.get("split")
        if not isinstance(file, str) or not isinstance(caption, str):
            rows.append(Skip(item, "malformed line: file and caption must be text", "caption"))
            continue
        has_split = has_split or "split" in record
        rows.append(Row(item, file, caption, split if isinstance(split, str) else None))
    return rows, has_split


def screen_rows(rows: list[Row | Skip], has_split: bool) -> tuple[list[Row], list[Skip]]:
    """Drop malformed and duplicate rows and rows whose split is missing or contradicts the
    file's first row; keep the others with their file name normalised (``./a.jpg`` is
    ``a.jpg``)."""
    kept: list[Row] = []
    skipped: list[Skip] = []
    first_of: dict[tuple[str, str], str] = {}  # (file, caption) -> the row that gave it first
    split_of: dict[str, tuple[str | None, str]] = {}  # file -> (its split, the row that set it)
    for row in rows:
        if isinstance(row, Skip):
            skipped.append(row)
            continue
        file = row.file.strip()
        file = PurePosixPath(file).as_posix() if file and not leaves_folder(file) else file
        split = (row.split or "").strip().lower() or None
        key = (file, " ".join(row.caption.split()))
        reason = ""
        if not file:
            reason = "no file name"
        elif "\0" in file:
            reason = "the file name holds a NUL byte"
        elif key in first_of:
            reason = f"duplicate row (the same file and caption as {first_of[key]})"
        elif has_split and split not in ("train", "val", "test"):
            reason = f"split {row.split!r} is not train, val or test"
        elif file in split_of and split_of[file][0] != split:
            prior, where = split_of[file]
            reason = f"split {split!r} contradicts {prior!r} given to {file!r} by {where}"
        if reason:
            skipped.append(Skip(row.item, reason, "caption"))
            continue
        first_of[key] = row.item
        split_of.setdefault(file, (split, row.item))
        kept.append(Row(row.item, file, row.caption, split))
    return kept, skipped
