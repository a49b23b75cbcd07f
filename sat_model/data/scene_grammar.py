"""The synthetic scenes' language: their words and the caption grammar over a scene's objects.

Objects are named "[size] [colour] shape" from ``SIZES`` × ``COLOURS`` × ``SHAPES``; captions come
from fixed templates keyed by the objects (read left to right), so a good model can reproduce
them, yet they name colours, sizes, counts and spatial relations. The generator
(:mod:`sat_model.data.scenes`) draws the objects; grounding (:mod:`sat_model.evaluation.grounding`)
maps these
words back onto them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["COLOURS", "SHAPES", "SHAPE_NOUNS", "SIZES", "Described", "scene_captions"]

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
# saturated hues, far from the muted backgrounds the generator draws
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 210, 30),
    "purple": (150, 60, 190),
    "orange": (245, 135, 25),
}
SIZES: tuple[str, ...] = ("small", "large")
SHAPE_NOUNS: dict[str, str] = {**{s: s for s in SHAPES}, **{s + "s": s for s in SHAPES}}

_NUMBERS = ("zero", "one", "two", "three", "four")


class Described(Protocol):
    """What the grammar and grounding need of an object: its words and where it is."""

    @property
    def shape(self) -> str: ...

    @property
    def colour(self) -> str: ...

    @property
    def size(self) -> str: ...

    @property
    def centre(self) -> tuple[float, float]: ...


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _full(o: Described) -> str:
    return _a(f"{o.size} {o.colour} {o.shape}")


def _short(o: Described) -> str:
    return _a(f"{o.colour} {o.shape}")


def _join(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _relation(a: Described, b: Described) -> str:
    """Where ``a`` is relative to ``b``, along the axis where their centres differ most."""
    dx, dy = b.centre[0] - a.centre[0], b.centre[1] - a.centre[1]
    if abs(dx) >= abs(dy):
        return "to the left of" if dx > 0 else "to the right of"
    return "above" if dy > 0 else "below"  # image y grows downwards


def _position(o: Described, image_size: int) -> str:
    """Which third of the image, across and down, holds the object's centre."""
    cx, cy = o.centre
    h = ("left", "centre", "right")[min(int(3 * cx / image_size), 2)]
    v = ("top", "middle", "bottom")[min(int(3 * cy / image_size), 2)]
    if h == "centre" and v == "middle":
        return "in the middle"
    if v == "middle":
        return f"on the {h}"
    return f"at the {v}" if h == "centre" else f"at the {v} {h}"


def _counts(objects: Sequence[Described]) -> str:
    order = list(dict.fromkeys(o.shape for o in objects))  # first appearance, left to right
    n = {s: sum(o.shape == s for o in objects) for s in order}
    parts = [f"{_NUMBERS[n[s]]} {s}{'s' if n[s] > 1 else ''}" for s in order]
    verb = "is" if n[order[0]] == 1 else "are"  # agrees with the first noun phrase
    return f"there {verb} {_join(parts)}"


def scene_captions(objects: Sequence[Described], background: str, image_size: int) -> list[str]:
    """Six captions for a scene, each true of it; objects are named left to right."""
    n = len(objects)
    if n == 0:
        raise ValueError("a scene needs at least one object to describe")
    shapes = f"{_NUMBERS[n]} shape{'s' if n > 1 else ''}"
    listing = _join([_full(o) for o in objects])
    if n == 1:
        (o,) = objects
        third = f"{_full(o)} on {_a(background)} background"
        fourth = f"{_short(o)} {_position(o, image_size)}"
    else:
        a, b = objects[0], objects[1]
        third = f"{_full(a)} {_relation(a, b)} {_full(b)}"
        fourth = f"{_short(b)} {_relation(b, a)} {_short(a)}"
    return [
        listing,
        f"{shapes}: {_join([_short(o) for o in objects])}",
        third,
        fourth,
        _counts(objects),
        f"{shapes} on {_a(background)} background",
    ]
