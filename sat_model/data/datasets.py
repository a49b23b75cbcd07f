"""Where each public dataset is distributed, and what its reader expects under ``data.root``.

The profiles read ``datasets/<name>/`` at the repository root (git-ignored; docs/guide/datasets.md
lays each one out). A dataset that is not in place stops prepare before anything is read, with
one line: what is missing, where the files are distributed and where they go.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sat_model.config import DataConfig

__all__ = ["GUIDE", "KARPATHY_SPLITS", "missing_dataset"]

GUIDE = "docs/guide/datasets.md"
KARPATHY_SPLITS = "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"


@dataclass(frozen=True)
class _Distribution:
    name: str
    photos: str  # the archive(s) of the photos
    captions: str  # the caption files in the dataset's own format ("" if it has none we read)
    url: str  # where both are distributed


_DISTRIBUTIONS = {
    "flickr8k": _Distribution(
        "Flickr8k",
        "Flickr8k_Dataset.zip",
        "Flickr8k_text.zip",
        "https://forms.illinois.edu/sec/1713398",
    ),
    "flickr30k": _Distribution(
        "Flickr30k", "flickr30k-images.tar.gz", "", "https://shannon.cs.illinois.edu/DenotationGraph/"
    ),
    "coco": _Distribution(
        "MS COCO 2014",
        "train2014.zip, val2014.zip",
        "annotations_trainval2014.zip",
        "https://cocodataset.org/#download",
    ),
}


def _folder(name: str) -> list[str]:
    return [] if name in ("", ".") else [f"{name.rstrip('/')}/"]


def _layout(data: DataConfig, s: Any) -> list[str]:
    """The files and folders (ending in ``/``) ``data.source`` reads under ``data.root``; ``s``
    is the source's settings (``data.<source>``)."""
    if data.source == "flickr8k":
        # the lists of the splits a run requires (our copy holds no test)
        lists = {"train": s.train_list, "val": s.val_list, "test": s.test_list}
        return [*_folder(s.images_dir), s.token_file, *(lists[k] for k in data.required_splits)]
    if data.source == "karpathy":
        return [s.json_file, *_folder(s.images_dir)]
    if data.source == "coco":
        return [*s.annotation_files, *(d for n in s.images_dirs for d in _folder(n))]
    if data.source == "folder":
        return [*_folder(s.images_dir), s.captions_file]
    return []  # a source registered elsewhere: its reader says what it lacks


def _where_to_get(data: DataConfig, s: Any, layout: list[str]) -> tuple[str, str]:
    """(the dataset's name, the sentence saying where its files are distributed and where they
    go) for ``data.source``."""
    put = f"put {', '.join(layout)} there" if layout else "put them there"
    if data.source == "folder":
        return "your own data", (
            "Point data.root at your photos' folder and data.folder.captions_file at their "
            "captions file (relative to data.root)"
        )
    if data.source == "karpathy":
        split = s.json_file
        match = re.fullmatch(r"dataset_(\w+)\.json", Path(split).name)
        known = _DISTRIBUTIONS.get(match.group(1) if match else "")
        photos = f"{known.photos} from {known.url}" if known else "the photos it names"
        if s.images_dir in ("", "."):
            put += ", with the photos' folders its filepath names"
        return (known.name if known else split), (
            f"Get {split} from Karpathy's {KARPATHY_SPLITS} and {photos}, and {put}"
        )
    known = _DISTRIBUTIONS.get(data.source)
    if known is None:
        return f"data source {data.source!r}", f"Get its files and {put}"
    return known.name, f"Get {known.photos} and {known.captions} from {known.url}, and {put}"


def _present(root: Path, entry: str) -> bool:
    return (root / entry).is_dir() if entry.endswith("/") else (root / entry).is_file()


def _lacking(root: Path, entry: str, layout: list[str]) -> str:
    """``entry`` as missing, with the near name found in its place (``Flicker8k_Dataset``),
    never another file of the layout."""
    path = root / entry.rstrip("/")
    expected = {(root / e.rstrip("/")).name for e in layout}
    siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    others = [n for n in siblings if n not in expected]
    near = difflib.get_close_matches(path.name, others, n=1, cutoff=0.9)
    return f"{entry} (found {near[0]}: rename it)" if near else entry


def missing_dataset(data: DataConfig, root: Path, settings: Any) -> str:
    """``""`` when ``root`` holds what ``data.source`` reads (with ``settings``, its section),
    else the one line saying what is missing, where to get it and where to put it."""
    layout = _layout(data, settings)
    if not root.is_dir():
        state = "is not a folder"
    elif missing := [_lacking(root, e, layout) for e in layout if not _present(root, e)]:
        state = f"lacks {', '.join(missing)}"
    else:
        return ""
    name, where = _where_to_get(data, settings, layout)
    return f"{name}: data.root {root} {state}. {where} ({GUIDE})"
