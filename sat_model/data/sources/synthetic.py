"""The generated scenes, described like any source (their images written as PNGs)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from sat_model.config import Section
from sat_model.data.scenes import generate_scenes
from sat_model.data.sources.records import OK, SourceCaption, SourceData, SourceImage
from sat_model.data.sources.registry import register_source
from sat_model.data.tables import Box

__all__ = ["SyntheticConfig", "read_synthetic"]


# ----------------------------------------------------------------------------- data
class SyntheticConfig(Section):
    """The generated scenes: captioned pictures of coloured shapes, with every object's box."""

    seed: int = Field(0, description="seed of the generator: the same seed, the same scenes")
    train_images: int = Field(5000, ge=1, description="scenes in the train split")
    val_images: int = Field(
        250, ge=1, description="scenes in the val split (what `train.val_images` scores)"
    )
    test_images: int = Field(500, ge=1, description="scenes in the test split")
    image_size: int = Field(224, ge=64, description="side of each square picture, in pixels")
    captions_per_image: int = Field(5, ge=1, description="reference captions per scene")
    min_objects: int = Field(1, ge=1, description="fewest shapes in a scene")
    max_objects: int = Field(4, ge=1, le=4, description="most shapes in a scene")

    @model_validator(mode="after")
    def _objects_range(self) -> SyntheticConfig:
        if self.min_objects > self.max_objects:
            raise ValueError("min_objects must not exceed max_objects")
        return self


# ---------------------------------------------------------------------------- synthetic
def read_synthetic(
    images_dir: Path, settings: SyntheticConfig, workers: int | None = None
) -> SourceData:
    """Generate the scenes (PNGs into ``images_dir``) and describe them like any source."""
    c = settings
    split_sizes = {"train": c.train_images, "val": c.val_images, "test": c.test_images}
    scenes = generate_scenes(
        images_dir,
        split_sizes,
        c.seed,
        c.image_size,
        c.min_objects,
        c.max_objects,
        c.captions_per_image,
        workers,
    )
    images, captions = [], []
    for s in scenes:
        boxes = tuple(
            Box(*o.box, label=o.label, shape=o.shape, colour=o.colour, size=o.size)
            for o in s.objects
        )
        images.append(SourceImage(s.image_id, s.split, f"{s.image_id}.png", OK, boxes))
        captions += [
            SourceCaption(s.image_id, c, f"{s.image_id}#{i}") for i, c in enumerate(s.captions)
        ]
    return SourceData("synthetic", Path(images_dir).resolve(), tuple(images), tuple(captions))


@register_source(
    "synthetic",
    settings=SyntheticConfig,
    needs_root=False,
    images=lambda s, root, prepared: prepared / "images",
)
def _synthetic(
    settings: SyntheticConfig, root: Path, prepared_dir: Path, workers: int | None
) -> SourceData:
    return read_synthetic(prepared_dir / "images", settings, workers)
