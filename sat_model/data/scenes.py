"""Synthetic scenes: coloured shapes with boxes and captions that are true of the picture.

A scene holds 1-4 non-overlapping objects, each a (size, colour, shape) drawn from
``SIZES`` × ``COLOURS`` × ``SHAPES``, on a plain, gradient or noise-textured background. Its
captions come from fixed templates keyed by the scene (objects read left to right), so a good
model can reproduce them (the language is learnable), yet they name colours, sizes, counts and
spatial relations (it is not trivial).

Everything is deterministic from ``(seed, split, index)``: one image never depends on how many
others are generated. Object sizes are in pixels at 224 (``SIZE_RANGES``) and scale with the
image so objects stay visible on a 14×14 feature grid (16 px cells at 224).

The words and the caption grammar live in :mod:`sat_model.data.scene_grammar`; matching a caption's
words back onto the objects in :mod:`sat_model.evaluation.grounding`.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from sat_model.atomic import write_bytes_atomic
from sat_model.data.scene_grammar import COLOURS, SHAPES, SIZES, scene_captions

__all__ = [
    "BACKGROUNDS",
    "SIZE_RANGES",
    "Scene",
    "SceneObject",
    "generate_scene",
    "generate_scenes",
    "render_scene",
    "scene_id",
]

# side of the object's square footprint at 224 px: small ~3 grid cells, large ~6 (14×14 grid)
SIZE_RANGES: dict[str, tuple[int, int]] = {"small": (40, 56), "large": (80, 100)}
BACKGROUNDS: tuple[str, ...] = ("plain", "gradient", "textured")

_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
_MARGIN = 4  # px at 224 between an object and the image border
_GAP = 8  # px at 224 between two objects' boxes, so they never touch
_PLACEMENT_TRIES = 200


@dataclass(frozen=True)
class SceneObject:
    """One shape; ``box`` is its tight pixel box ``(x0, y0, x1, y1)``."""

    shape: str
    colour: str
    size: str
    box: tuple[float, float, float, float]
    footprint: tuple[float, float, float, float]  # the square the shape is inscribed in
    rgb: tuple[int, int, int]  # the drawn fill: the named colour with a little jitter

    @property
    def label(self) -> str:
        return f"{self.size} {self.colour} {self.shape}"

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass(frozen=True)
class Scene:
    """Everything needed to draw an image and the captions that describe it."""

    image_id: str
    split: str
    image_size: int
    objects: tuple[SceneObject, ...]  # left to right by box centre
    background: str
    background_rgb: tuple[tuple[int, int, int], tuple[int, int, int]]
    gradient_vertical: bool
    noise_seed: int
    captions: tuple[str, ...]


def scene_id(split: str, index: int) -> str:
    """Image id of scene ``index`` of ``split`` (also its PNG file stem)."""
    return f"{split}_{index:05d}"


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    if split not in _SPLIT_CODES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(_SPLIT_CODES)}")
    return np.random.default_rng([seed, _SPLIT_CODES[split], index])


def _overlaps(a: tuple[float, ...], b: tuple[float, ...], gap: float) -> bool:
    return not (
        a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]
    )


def _side(rng: np.random.Generator, size: str, scale: float) -> int:
    lo, hi = SIZE_RANGES[size]
    return round(rng.integers(lo, hi + 1) * scale)


def _place(
    rng: np.random.Generator, side: int, taken: list[tuple[float, ...]], image_size: int
) -> tuple[float, float, float, float] | None:
    scale = image_size / 224
    margin, gap = _MARGIN * scale, _GAP * scale
    hi = image_size - margin - side
    for _ in range(_PLACEMENT_TRIES):
        x0, y0 = rng.uniform(margin, hi, size=2)
        box = (float(x0), float(y0), float(x0 + side), float(y0 + side))
        if not any(_overlaps(box, t, gap) for t in taken):
            return box
    return None


def _shape_points(shape: str, box: tuple[float, ...]) -> list[tuple[float, float]]:
    """Polygon vertices of ``shape`` inscribed in the square ``box`` (circle: its box corners)."""
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "star":
        angles = np.deg2rad(-90 + 36 * np.arange(10))
        radii = np.where(np.arange(10) % 2 == 0, r, 0.45 * r)
        return list(zip(cx + radii * np.cos(angles), cy + radii * np.sin(angles), strict=True))
    return [(x0, y0), (x1, y1)]  # circle and square are drawn from their box


def _tight_box(shape: str, box: tuple[float, ...]) -> tuple[float, float, float, float]:
    xs, ys = zip(*_shape_points(shape, box), strict=True)
    return (float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys)))


def _sample_objects(rng: np.random.Generator, n: int, image_size: int) -> tuple[SceneObject, ...]:
    scale = image_size / 224
    objects: list[SceneObject] = []
    footprints: list[tuple[float, ...]] = []
    for _ in range(n):
        shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(6)]
        size = SIZES[rng.integers(len(SIZES))]
        box = _place(rng, _side(rng, size, scale), footprints, image_size)
        if box is None and size == "large":  # a crowded scene: fall back to a small object
            size = "small"
            box = _place(rng, _side(rng, size, scale), footprints, image_size)
        if box is None:
            continue  # no room left; the scene keeps the objects placed so far
        jitter = rng.integers(-12, 13, size=3)
        rgb = tuple(int(v) for v in np.clip(np.array(COLOURS[colour]) + jitter, 0, 255))
        footprints.append(box)
        objects.append(SceneObject(shape, colour, size, _tight_box(shape, box), box, rgb))  # type: ignore[arg-type]
    return tuple(sorted(objects, key=lambda o: o.centre))


def _muted(rng: np.random.Generator) -> tuple[int, int, int]:
    # low saturation, mid-to-light value: every object colour stands out against it
    base = int(rng.integers(110, 215))
    return tuple(int(v) for v in np.clip(base + rng.integers(-18, 19, size=3), 0, 255))  # type: ignore[return-value]


def generate_scene(
    seed: int,
    split: str,
    index: int,
    image_size: int = 224,
    min_objects: int = 1,
    max_objects: int = 4,
    captions_per_image: int = 5,
) -> Scene:
    """The layout and captions of scene ``index`` of ``split`` (no pixels: see render_scene)."""
    if not 1 <= min_objects <= max_objects <= 4:
        raise ValueError(
            f"need 1 <= min_objects <= max_objects <= 4, got {min_objects}, {max_objects}"
        )
    rng = _rng(seed, split, index)
    objects = _sample_objects(rng, int(rng.integers(min_objects, max_objects + 1)), image_size)
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    scene = Scene(
        image_id=scene_id(split, index),
        split=split,
        image_size=image_size,
        objects=objects,
        background=background,
        background_rgb=(_muted(rng), _muted(rng)),
        gradient_vertical=bool(rng.integers(2)),
        noise_seed=int(rng.integers(2**31)),
        captions=(),
    )
    templates = scene_captions(objects, background, image_size)
    captions = tuple(templates[i % len(templates)] for i in range(captions_per_image))
    return replace(scene, captions=captions)


# ------------------------------------------------------------------------------ drawing
def _background(scene: Scene) -> np.ndarray:
    s = scene.image_size
    c0, c1 = (np.array(c, dtype=np.float32) for c in scene.background_rgb)
    if scene.background == "plain":
        return np.broadcast_to(c0, (s, s, 3)).copy()  # (H, W, 3)
    if scene.background == "gradient":
        t = np.linspace(0.0, 1.0, s, dtype=np.float32)[:, None, None]  # (H, 1, 1)
        img = (1 - t) * c0 + t * c1  # (H, 1, 3)
        img = np.broadcast_to(img, (s, s, 3))
        return (img if scene.gradient_vertical else img.transpose(1, 0, 2)).copy()
    # textured: coarse noise (8 px cells) plus fine grain, around the base colour
    rng = np.random.default_rng(scene.noise_seed)
    cells = -(-s // 8)
    coarse = rng.normal(0, 14, size=(cells, cells, 1)).repeat(8, 0).repeat(8, 1)[:s, :s]
    return c0 + coarse + rng.normal(0, 6, size=(s, s, 1))  # (H, W, 3)


def render_scene(scene: Scene) -> Image.Image:
    """Draw ``scene`` as an RGB image of ``image_size``² pixels."""
    pixels = np.clip(_background(scene), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, mode="RGB")
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        points = _shape_points(o.shape, o.footprint)
        if o.shape == "circle":
            draw.ellipse(o.footprint, fill=o.rgb)
        elif o.shape == "square":
            draw.rectangle(o.footprint, fill=o.rgb)
        else:
            draw.polygon(points, fill=o.rgb)
    return image


# ------------------------------------------------------------------------------ writing
def _write_one(
    args: tuple[Path, int, str, int, int, int, int, int],
) -> Scene:
    out_dir, seed, split, index, image_size, min_objects, max_objects, n_captions = args
    scene = generate_scene(seed, split, index, image_size, min_objects, max_objects, n_captions)
    buf = io.BytesIO()
    # compress_level 1: these files are re-read once by extract; speed matters more than size
    render_scene(scene).save(buf, format="PNG", compress_level=1)
    # no fsync per PNG: thousands of them, and a lost one is regenerated bit for bit
    write_bytes_atomic(out_dir / f"{scene.image_id}.png", buf.getvalue(), durable=False)
    return scene


def generate_scenes(
    out_dir: str | Path,
    split_sizes: dict[str, int],
    seed: int,
    image_size: int = 224,
    min_objects: int = 1,
    max_objects: int = 4,
    captions_per_image: int = 5,
    workers: int | None = None,
) -> list[Scene]:
    """Generate every split's scenes, write ``<image_id>.png`` into ``out_dir``, return them.

    PNGs in ``out_dir`` that this call did not write are removed, so the folder holds exactly
    the returned scenes. ``workers`` processes (default: the CPU count) share the drawing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (out, seed, split, i, image_size, min_objects, max_objects, captions_per_image)
        for split, n in split_sizes.items()
        for i in range(n)
    ]
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) < 64:
        scenes = [_write_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            scenes = list(pool.map(_write_one, jobs, chunksize=64))
    keep = {f"{s.image_id}.png" for s in scenes}
    for stale in out.glob("*.png"):
        if stale.name not in keep:
            stale.unlink()
    return scenes
