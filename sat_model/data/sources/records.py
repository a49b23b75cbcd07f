"""What every caption source returns (:class:`SourceData`) and the helpers its reader shares.

A reader parses its source's metadata only: which images exist, their split and file, and
their raw captions. It never opens an image (``sat_model.data.prepare`` checks files for every
source alike). Problems found while parsing are kept, not raised: an image gets a ``status``
other than ``"ok"`` (a duplicate id, no split, ...) and a caption that cannot be attached to
an image becomes a :class:`Skip`. Items left out on purpose by a params setting (Karpathy's
``restval``, COCO captions beyond the first five) carry reasons starting with
``EXCLUDED`` and do not count as bad input.

``file`` is the name as written in the source, relative to ``image_root``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from sat_model.data.tables import Box

__all__ = [
    "EXCLUDED",
    "LEAVES_FOLDER",
    "OK",
    "ImageRows",
    "Skip",
    "SourceCaption",
    "SourceData",
    "SourceError",
    "SourceImage",
    "attach",
    "leaves_folder",
    "lines",
    "load_json",
    "read_bytes",
    "stem",
]

EXCLUDED = "excluded"
OK = "ok"
LEAVES_FOLDER = "file name leaves the dataset folder"


class SourceError(ValueError):
    """Raised when a source cannot be read at all (a missing or unparseable index file)."""


@dataclass(frozen=True)
class SourceImage:
    image_id: str
    split: str | None
    file: str
    status: str = OK
    boxes: tuple[Box, ...] = ()


@dataclass(frozen=True)
class SourceCaption:
    image_id: str
    raw: str
    item: str  # where it came from, for skip messages ("Flickr8k.token.txt line 12")


@dataclass(frozen=True)
class Skip:
    item: str
    reason: str
    kind: Literal["image", "caption"]

    @property
    def excluded(self) -> bool:
        return self.reason.startswith(EXCLUDED)


@dataclass(frozen=True)
class SourceData:
    source: str
    image_root: Path  # absolute
    images: tuple[SourceImage, ...]
    # captions attached to an image row (usable or not: prepare counts those of skipped images)
    captions: tuple[SourceCaption, ...]
    skipped: tuple[Skip, ...] = field(default=())  # captions dropped while parsing


class ImageRows:
    """Collects image rows in source order; the first row of an id wins, later ones are marked."""

    def __init__(self) -> None:
        self.rows: list[SourceImage] = []
        self.first: dict[str, SourceImage] = {}  # id -> its usable row
        self.best: dict[str, SourceImage] = {}  # id -> its usable row, else its first row

    def add(self, image: SourceImage) -> SourceImage:
        if leaves_folder(image.file):
            image = SourceImage(image.image_id, image.split, image.file, LEAVES_FOLDER)
        self.best.setdefault(image.image_id, image)
        if image.status != OK:  # an unusable row never blocks a later valid one with its id
            self.rows.append(image)
            return image
        if image.image_id in self.first:
            prior = self.first[image.image_id]
            image = SourceImage(
                image.image_id,
                image.split,
                image.file,
                f"duplicate image id {image.image_id!r} (first listed as {prior.file!r}"
                f" in split {prior.split})",
            )
        else:
            self.first[image.image_id] = self.best[image.image_id] = image
        self.rows.append(image)
        return image


def leaves_folder(file: str) -> bool:
    """True for a name that points outside the dataset folder (absolute, ``..``, a drive)."""
    # string tests, not PurePosixPath/PureWindowsPath objects: called for every caption row
    return (
        not file.strip()
        or file.startswith("/")
        or ".." in file.split("/")
        or "\\" in file
        or (file[1:2] == ":" and file[:1].isascii() and file[:1].isalpha())  # a drive, C:
    )


def attach(
    row: SourceImage, raw: str, item: str, captions: list[SourceCaption], skipped: list[Skip]
) -> None:
    """Add a caption of ``row``; one of an unusable row is skipped, never given to another row
    that shares its id (``../a.jpg`` and ``a.jpg`` both have the id ``a``)."""
    if row.status == OK:
        captions.append(SourceCaption(row.image_id, raw, item))
    elif row.status.startswith(EXCLUDED):
        skipped.append(Skip(item, row.status, "caption"))
    else:
        skipped.append(Skip(item, f"image skipped: {row.status}", "caption"))


def stem(name: str) -> str:
    return PurePosixPath(name).stem if name.strip() else name


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise SourceError(f"cannot read {what} {path}: {e.strerror or e}") from e


def lines(path: Path, what: str) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text or None when not UTF-8) for each non-blank line."""
    for n, raw in enumerate(read_bytes(path, what).split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            yield n, None
            continue
        if line.strip():
            yield n, line


# ----------------------------------------------------------------------------- karpathy
def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(read_bytes(path, what))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise SourceError(f"{what} {path} must hold a JSON object")
    return data
