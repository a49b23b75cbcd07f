"""Pointing accuracy: does the peak of α_t land on the object the word names?

Dimensions: ``L = grid_h × grid_w`` annotation locations (row-major, as the encoder's feature
map is flattened); ``len`` words of one generated caption.

α is defined over the feature grid of the *centre-cropped* image (extract resized the shorter side
to ``resize``, then cropped ``crop × crop`` from the centre, Sec. 3.1.1 in docs/METHOD.md).
Boxes are in
the original image's pixels, so they are first mapped into the crop's frame, and a word counts as
a hit when the centre of its peak cell lies inside (any of) the box(es) the word names.
Which boxes a word names is :func:`ground_tokens`' answer, from the scenes' words alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from sat_model.data.scene_grammar import COLOURS, SHAPE_NOUNS, SIZES, Described
from sat_model.data.tables import Box

__all__ = [
    "GroundingSample",
    "PointingResult",
    "box_to_crop",
    "cell_centre",
    "crop_geometry",
    "ground_tokens",
    "peak_hits_box",
    "pointing_accuracy",
]


@dataclass(frozen=True)
class CropGeometry:
    """Scale then offset that maps original pixels into the centre crop: ``x' = x*scale - left``."""

    scale_x: float
    scale_y: float
    left: int
    top: int
    crop: int


@dataclass(frozen=True)
class GroundingSample:
    """One generated caption: α per word (len, L), the image's boxes (original pixels), and
    for each word the indices of the boxes it names (empty: the word names no object)."""

    alphas: np.ndarray
    boxes: Sequence[Box]
    targets: Sequence[tuple[int, ...]]
    width: int
    height: int


@dataclass(frozen=True)
class PointingResult:
    hits: int
    total: int

    @property
    def accuracy(self) -> float:
        # no grounded word at all is "not measured", not 0 and not 1
        return self.hits / self.total if self.total else float("nan")


def crop_geometry(
    width: int, height: int, resize: int, crop: int, keep_aspect: bool = True
) -> CropGeometry:
    """The resize-shorter-side-then-centre-crop transform, computed as torchvision does it.

    ``Resize(resize)`` sets the short side to ``resize`` and the long side to
    ``int(resize * long / short)`` (truncated); ``CenterCrop(crop)`` offsets by
    ``int(round((size - crop) / 2))``. Without ``keep_aspect`` both sides go to ``resize``.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if crop > resize:
        raise ValueError(f"crop {crop} is larger than the resized short side {resize}")
    if not keep_aspect:
        new_w = new_h = resize
    elif width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    left = round((new_w - crop) / 2.0)
    top = round((new_h - crop) / 2.0)
    return CropGeometry(new_w / width, new_h / height, int(left), int(top), crop)


def box_to_crop(box: Box, geometry: CropGeometry) -> Box:
    """Map ``box`` from original pixels into the crop's frame (may extend past the crop)."""
    g = geometry
    return replace(
        box,
        x0=box.x0 * g.scale_x - g.left,
        y0=box.y0 * g.scale_y - g.top,
        x1=box.x1 * g.scale_x - g.left,
        y1=box.y1 * g.scale_y - g.top,
    )


def cell_centre(index: int, grid_h: int, grid_w: int, crop: int) -> tuple[float, float]:
    """Centre ``(x, y)`` in crop pixels of flattened cell ``index`` (row-major over h×w)."""
    if not 0 <= index < grid_h * grid_w:
        raise ValueError(f"cell index {index} outside a {grid_h}x{grid_w} grid")
    row, col = divmod(index, grid_w)
    return (col + 0.5) * crop / grid_w, (row + 0.5) * crop / grid_h


def peak_hits_box(
    alpha: np.ndarray, boxes_in_crop: Sequence[Box], grid_h: int, grid_w: int, crop: int
) -> bool:
    """True when the centre of α's peak cell lies inside any of ``boxes_in_crop``."""
    if alpha.shape != (grid_h * grid_w,):
        raise ValueError(f"alpha has shape {alpha.shape}, expected ({grid_h * grid_w},)")
    x, y = cell_centre(int(np.argmax(alpha)), grid_h, grid_w, crop)
    return any(b.contains(x, y) for b in boxes_in_crop)


def pointing_accuracy(
    samples: Iterable[GroundingSample],
    *,
    grid_h: int,
    grid_w: int,
    resize: int,
    crop: int,
    keep_aspect: bool = True,
) -> PointingResult:
    """Share of object-naming words whose α peak lies on the named object.

    Words with no target are not counted. A word naming several objects (two "circle"s) hits
    when the peak falls on any of them, since the caption alone cannot say which was meant.
    """
    hits = total = 0
    for sample in samples:
        if len(sample.targets) != len(sample.alphas):
            raise ValueError(f"{len(sample.targets)} word targets but {len(sample.alphas)} α rows")
        geometry = crop_geometry(sample.width, sample.height, resize, crop, keep_aspect)
        for t, target in enumerate(sample.targets):
            if not target:
                continue
            in_crop = [box_to_crop(sample.boxes[i], geometry) for i in target]
            total += 1
            hits += peak_hits_box(sample.alphas[t], in_crop, grid_h, grid_w, crop)
    return PointingResult(hits=hits, total=total)


def ground_tokens(tokens: Sequence[str], objects: Sequence[Described]) -> list[tuple[int, ...]]:
    """For each token, the indices of ``objects`` it names (empty for other words).

    A shape noun ("circle", "circles") names the objects of that shape that also match the
    size and colour words right before it ("large red circle"). A noun naming nothing in the
    scene (a hallucinated object) gives an empty tuple, like any non-object word.
    """
    out: list[tuple[int, ...]] = []
    for i, token in enumerate(tokens):
        shape = SHAPE_NOUNS.get(token)
        if shape is None:
            out.append(())
            continue
        modifiers = set()
        j = i - 1
        while j >= 0 and (tokens[j] in COLOURS or tokens[j] in SIZES):
            modifiers.add(tokens[j])
            j -= 1
        out.append(
            tuple(
                k
                for k, o in enumerate(objects)
                if o.shape == shape and modifiers <= {o.colour, o.size}
            )
        )
    return out
