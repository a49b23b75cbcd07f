"""Karpathy's split files (``dataset_{flickr8k,flickr30k,coco}.json``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from sat_model.config import Bool, Section
from sat_model.data.sources.records import (
    EXCLUDED,
    OK,
    ImageRows,
    Skip,
    SourceCaption,
    SourceData,
    SourceImage,
    attach,
    load_json,
    stem,
)
from sat_model.data.sources.registry import register_source

__all__ = ["KarpathyConfig", "read_karpathy"]


class KarpathyConfig(Section):
    """Karpathy's split files (`dataset_flickr8k.json`, `_flickr30k`, `_coco`)."""

    json_file: str = Field("dataset_flickr8k.json", description="the split file, under data.root")
    images_dir: str = Field("Flickr8k_Dataset", description="folder of the photos, under data.root")
    restval_to_train: Bool = Field(
        True,
        description="train on the 'restval' images (COCO), as usual; false drops them with "
        "a reason",
    )


def read_karpathy(
    root: Path, json_file: str, images_dir: str, restval_to_train: bool
) -> SourceData:
    """Karpathy's split file (``dataset_{flickr8k,flickr30k,coco}.json``)."""
    data = load_json(root / json_file, "Karpathy split file")
    images = ImageRows()
    captions: list[SourceCaption] = []
    skipped: list[Skip] = []
    for k, entry in enumerate(data.get("images", [])):
        name = str(entry.get("filename", ""))
        file = f"{entry['filepath']}/{name}" if entry.get("filepath") else name
        # COCO entries carry the COCO id, so Karpathy-COCO and raw COCO agree on ids
        image_id = str(entry["cocoid"]) if "cocoid" in entry else stem(name)
        split, status = entry.get("split"), OK
        if split == "restval":
            split = "train" if restval_to_train else None
            status = OK if restval_to_train else f"{EXCLUDED}: restval (karpathy.restval_to_train)"
        elif split not in ("train", "val", "test"):
            split, status = None, f"image is in no split (split {entry.get('split')!r})"
        row = images.add(SourceImage(image_id, split, file, status))
        for j, sentence in enumerate(entry.get("sentences", [])):
            item = f"{json_file} image {k} sentence {j}"
            raw = sentence.get("raw") if isinstance(sentence, dict) else None
            if not isinstance(raw, str):
                skipped.append(Skip(item, "sentence has no raw text", "caption"))
                continue
            attach(row, raw, item, captions, skipped)
    return SourceData(
        "karpathy",
        (root / images_dir).resolve(),
        tuple(images.rows),
        tuple(captions),
        tuple(skipped),
    )


@register_source(
    "karpathy", settings=KarpathyConfig, images=lambda s, root, prepared: root / s.images_dir
)
def _karpathy(
    settings: KarpathyConfig, root: Path, prepared_dir: Path, workers: int | None
) -> SourceData:
    k = settings
    return read_karpathy(root, k.json_file, k.images_dir, k.restval_to_train)
