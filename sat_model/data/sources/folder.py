"""Your own photos: a folder of images and a captions file (CSV or JSON lines)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from pydantic import Field

from sat_model.config import Section
from sat_model.data.sources.folder_rows import csv_rows, jsonl_rows, screen_rows
from sat_model.data.sources.records import (
    ImageRows,
    SourceCaption,
    SourceData,
    SourceImage,
    attach,
    leaves_folder,
)
from sat_model.data.sources.registry import register_source

__all__ = ["FolderConfig", "read_folder"]


class FolderConfig(Section):
    """Your own photos: a folder of images and a captions file (CSV or JSON lines) with the
    columns `file`, `caption` and an optional `split`; paths relative to `data.root`."""

    images_dir: str = Field(".", description="folder of the photos, under data.root")
    captions_file: str = Field("captions.csv", description="the captions file, under data.root")
    format: Literal["auto", "csv", "jsonl"] = Field(
        "auto", description="auto: by the file's extension (.jsonl and .json are JSON lines)"
    )
    val_images: int = Field(
        50,
        ge=0,
        description="without a split column: a seeded draw of this many images for val; "
        "the rest trains",
    )
    test_images: int = Field(50, ge=0, description="without a split column: the same for test")
    seed: int = Field(0, description="seed of that draw")


def _draw_splits(files: list[str], val_images: int, test_images: int, seed: int) -> dict[str, str]:
    """A seeded draw: ``val_images`` files val, ``test_images`` test, the rest train."""
    ordered = sorted(files)
    pool = [ordered[i] for i in np.random.default_rng(seed).permutation(len(files))]
    return {
        file: "val" if i < val_images else "test" if i < val_images + test_images else "train"
        for i, file in enumerate(pool)
    }


def read_folder(root: Path, settings: FolderConfig) -> SourceData:
    """A folder of photos and a captions file (CSV or JSON lines: ``file``, ``caption`` and an
    optional ``split``; one row per caption). ``file`` is relative to ``images_dir`` and is the
    image's id. Without a split column the images are split by :func:`_draw_splits`."""
    images_dir, captions_file, fmt = settings.images_dir, settings.captions_file, settings.format
    path = root / captions_file
    if fmt == "auto":
        fmt = "jsonl" if path.suffix.lower() in (".jsonl", ".json") else "csv"
    read = jsonl_rows if fmt == "jsonl" else csv_rows
    rows, has_split = read(path, PurePosixPath(captions_file).name)
    kept, skipped = screen_rows(rows, has_split)
    files = list(dict.fromkeys(r.file for r in kept))  # first-row order
    drawn = (
        {}
        if has_split
        else _draw_splits(
            [f for f in files if not leaves_folder(f)],
            settings.val_images,
            settings.test_images,
            settings.seed,
        )
    )
    images = ImageRows()
    row_of: dict[str, SourceImage] = {}
    for row in kept:
        if row.file not in row_of:
            split = row.split if has_split else drawn.get(row.file)
            row_of[row.file] = images.add(SourceImage(row.file, split, row.file))
    captions: list[SourceCaption] = []
    for row in kept:
        attach(row_of[row.file], row.caption, row.item, captions, skipped)
    return SourceData(
        "folder", (root / images_dir).resolve(), tuple(images.rows), tuple(captions), tuple(skipped)
    )


@register_source(
    "folder", settings=FolderConfig, images=lambda s, root, prepared: root / s.images_dir
)
def _folder(
    settings: FolderConfig, root: Path, prepared_dir: Path, workers: int | None
) -> SourceData:
    return read_folder(root, settings)
