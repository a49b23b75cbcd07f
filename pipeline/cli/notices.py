"""What a user is told beside a result: what the model knows, and an image to try it on.

The default pipeline trains on generated scenes of shapes (``data.source: synthetic``): its
champion captions a photo of two dogs as "a large red star and a small orange star". The
checkpoint records the source it was trained on (``config.json``'s ``data.source``), and every
command that shows what such a model says (``sat summary``, ``sat caption``, ``sat serve``)
says so, with how to get a model of photos.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.settings import Params

__all__ = ["PHOTOS_HOW", "SCENES_SOURCE", "example_image", "model_source", "scenes_notice"]

SCENES_SOURCE = "synthetic"  # the data source of the generated scenes (sat_model.data.scenes)
PHOTOS_HOW = "make run PROFILE=flickr8k (docs/guide/datasets.md)"


def scenes_notice(data_source: str | None, who: str = "this model captions") -> str | None:
    """One line on what a model trained on ``data_source`` knows when that is the generated
    scenes (``who``: the subject and its verb); None for any other source, or none recorded."""
    if data_source != SCENES_SOURCE:
        return None
    return (
        f"trained on the generated scenes of coloured shapes (data.source: {SCENES_SOURCE}), "
        f"{who} shapes, not what a photo shows; for a model of photos: {PHOTOS_HOW}"
    )


def model_source(model_dir: Path) -> str | None:
    """The data source a model folder's ``config.json`` records (None: absent or unrecorded)."""
    from sat_model.model.checkpoint import CONFIG_FILE, recorded_data_source

    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded_data_source(config) if isinstance(config, dict) else None


def example_image(params: Params, root: Path) -> Path | None:
    """The first test image of the project's prepared data (for the default pipeline a scene
    that ``make run`` generated), relative to the working directory where it can be; None
    before ``prepare`` has run."""
    from sat_model.data.sources import image_root
    from sat_model.data.tables import IMAGES_FILE, TableError, read_images

    try:
        images = read_images(
            root / params.data.prepared_dir / IMAGES_FILE, image_root(params.data, root), "test"
        )
    except (TableError, OSError):
        return None
    path = next((r.path for r in images if not r.refused), None)
    if path is None:
        return None
    cwd = Path.cwd().resolve()
    return path.relative_to(cwd) if path.is_relative_to(cwd) else path
