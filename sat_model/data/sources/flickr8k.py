"""Flickr8k as distributed: a ``name#n<TAB>caption`` token file and one list per split."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from pydantic import Field

from sat_model.config import Section
from sat_model.data.sources.records import (
    OK,
    ImageRows,
    Skip,
    SourceCaption,
    SourceData,
    SourceImage,
    attach,
    lines,
    stem,
)
from sat_model.data.sources.registry import register_source

__all__ = ["Flickr8kConfig", "read_flickr8k"]


class Flickr8kConfig(Section):
    """Flickr8k as distributed; paths relative to `data.root`."""

    images_dir: str = Field("Flickr8k_Dataset", description="folder of the photos")
    token_file: str = Field(
        "Flickr8k_text/Flickr8k.token.txt", description="captions, `<file>#<n>\\t<caption>`"
    )
    train_list: str = Field(
        "Flickr8k_text/Flickr_8k.trainImages.txt", description="file names of the train split"
    )
    val_list: str = Field(
        "Flickr8k_text/Flickr_8k.devImages.txt", description="file names of the val (dev) split"
    )
    test_list: str = Field(
        "Flickr8k_text/Flickr_8k.testImages.txt", description="file names of the test split"
    )


# ----------------------------------------------------------------------------- flickr8k
def read_flickr8k(
    root: Path, images_dir: str, token_file: str, split_lists: dict[str, str]
) -> SourceData:
    """Flickr8k as distributed: a ``name#n<TAB>caption`` token file and one list per split."""
    images, skipped = ImageRows(), []
    row_of: dict[str, SourceImage] = {}  # file name -> its first usable row (else first row)
    for split, rel in split_lists.items():
        for n, line in lines(root / rel, f"{split} split list"):
            if line is None:
                skipped.append(Skip(f"{rel} line {n}", "line is not UTF-8", "image"))
                continue
            name = line.strip()
            row = images.add(SourceImage(stem(name), split, name))
            if name not in row_of or (row.status == OK and row_of[name].status != OK):
                row_of[name] = row
    captions: list[SourceCaption] = []
    for n, line in lines(root / token_file, "token file"):
        item = f"{PurePosixPath(token_file).name} line {n}"
        if line is None:
            skipped.append(Skip(item, "line is not UTF-8", "caption"))
            continue
        name, tab, raw = line.partition("\t")
        name = name.rpartition("#")[0] if "#" in name else ""
        if not tab or not name:
            skipped.append(
                Skip(item, "malformed line: expected '<image>#<n><TAB><caption>'", "caption")
            )
            continue
        if name not in row_of:
            row_of[name] = images.add(SourceImage(stem(name), None, name, "image is in no split"))
        attach(row_of[name], raw, item, captions, skipped)
    return SourceData(
        "flickr8k",
        (root / images_dir).resolve(),
        tuple(images.rows),
        tuple(captions),
        tuple(skipped),
    )


@register_source(
    "flickr8k", settings=Flickr8kConfig, images=lambda s, root, prepared: root / s.images_dir
)
def _flickr8k(
    settings: Flickr8kConfig, root: Path, prepared_dir: Path, workers: int | None
) -> SourceData:
    f = settings
    lists = {"train": f.train_list, "val": f.val_list, "test": f.test_list}
    present = {k: v for k, v in lists.items() if (root / v).is_file()}  # the sample: no test list
    return read_flickr8k(root, f.images_dir, f.token_file, present)
