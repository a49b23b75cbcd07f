"""MS COCO 2014 captions; val and test are drawn from the files after the first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import Field

from sat_model.config import Bool, Section
from sat_model.data.sources.records import (
    EXCLUDED,
    OK,
    ImageRows,
    Skip,
    SourceCaption,
    SourceData,
    SourceError,
    SourceImage,
    attach,
    load_json,
)
from sat_model.data.sources.registry import register_source

__all__ = ["CocoConfig", "read_coco"]


class CocoConfig(Section):
    """MS COCO 2014 captions; val and test are drawn from the files after the first."""

    annotation_files: tuple[str, ...] = Field(
        (
            "annotations/captions_train2014.json",
            "annotations/captions_val2014.json",
        ),
        description="caption files under data.root; the first one trains",
    )
    images_dirs: tuple[str, ...] = Field(
        ("train2014", "val2014"), description="one photo folder per annotation file, same order"
    )
    val_images: int = Field(
        5000, ge=0, description="val images drawn from the held-out files (paper: 5000)"
    )
    test_images: int = Field(
        5000, ge=0, description="test images drawn from the held-out files (paper: 5000)"
    )
    seed: int = Field(0, description="seed of the val/test draw")
    max_captions_per_image: int = Field(
        5, ge=1, description="references kept per image (the paper truncates COCO to 5)"
    )
    restval_to_train: Bool = Field(
        True,
        description="held-out images beyond val/test train (as Karpathy's restval); "
        "false leaves them out",
    )


# --------------------------------------------------------------------------------- coco
def _coco_splits(ids: list[int], settings: CocoConfig) -> dict[int, str | None]:
    """Split the held-out pool: ``val_images`` val, ``test_images`` test, the rest train or none."""
    val_images, test_images = settings.val_images, settings.test_images
    ordered = sorted(ids)
    pool = [ordered[i] for i in np.random.default_rng(settings.seed).permutation(len(ids))]
    rest = "train" if settings.restval_to_train else None
    return {
        image_id: "val" if i < val_images else "test" if i < val_images + test_images else rest
        for i, image_id in enumerate(pool)
    }


def read_coco(root: Path, settings: CocoConfig) -> SourceData:
    """MS COCO captions JSON: the first file trains; val/test are drawn from the others."""
    annotation_files, images_dirs = settings.annotation_files, settings.images_dirs
    max_captions_per_image = settings.max_captions_per_image
    if len(annotation_files) != len(images_dirs):
        raise SourceError(
            f"{len(annotation_files)} annotation files but {len(images_dirs)} image folders"
        )
    files = [load_json(root / a, "COCO captions file") for a in annotation_files]
    held_out = sorted({int(im["id"]) for d in files[1:] for im in d.get("images", [])})
    split_of = _coco_splits(held_out, settings)
    images = ImageRows()
    captions: list[SourceCaption] = []
    skipped: list[Skip] = []
    for k, (data, folder, ann_file) in enumerate(
        zip(files, images_dirs, annotation_files, strict=True)
    ):
        for im in data.get("images", []):
            split = "train" if k == 0 else split_of[int(im["id"])]
            status = OK if split else f"{EXCLUDED}: held-out image beyond val/test (coco)"
            images.add(
                SourceImage(str(im["id"]), split, f"{folder}/{im.get('file_name', '')}", status)
            )
        per_image: dict[str, int] = {}
        for ann in sorted(
            data.get("annotations", []), key=lambda a: (a.get("image_id", -1), a.get("id", 0))
        ):
            image_id, item = str(ann.get("image_id")), f"{ann_file} annotation {ann.get('id')}"
            row = images.best.get(image_id)
            if row is None:
                reason = f"image id {image_id} is not in the images list"
                skipped.append(Skip(item, reason, "caption"))
            elif row.status == OK and per_image.get(image_id, 0) >= max_captions_per_image:
                reason = f"{EXCLUDED}: beyond coco.max_captions_per_image={max_captions_per_image}"
                skipped.append(Skip(item, reason, "caption"))
            else:
                per_image[image_id] = per_image.get(image_id, 0) + 1
                attach(row, str(ann.get("caption", "")), item, captions, skipped)
    return SourceData("coco", root.resolve(), tuple(images.rows), tuple(captions), tuple(skipped))


@register_source("coco", settings=CocoConfig)  # file names carry their images_dirs folder
def _coco(settings: CocoConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    c = settings
    return read_coco(root, c)
