"""Reading attention figures and their index page back as a person would see them.

Plain functions (``from tests.figures import ...``) for the tests of ``sat caption
--attention-out``, the evaluate stage's gallery and the visualizer: a figure's panels are found
from its pixels (framed rectangles on a white page), the page is parsed as HTML.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["IndexPage", "figure_panels", "read_index"]

# a panel is at least this many pixels on each side; a line of words under a row is far less tall
_MIN_PANEL_PX = 40


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` stretches where the 1-D ``mask`` is true."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def figure_panels(path: Path) -> list[list[tuple[int, int, int, int]]]:
    """The panels of a figure PNG, row by row: ``(x0, y0, x1, y1)`` boxes of non-white pixels
    at least ``_MIN_PANEL_PX`` on each side (the words under them are shorter)."""
    rgb = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)  # (H, W, 3)
    ink = (rgb < 245).any(-1)  # (H, W): anything but the white page
    rows = []
    for y0, y1 in _runs(ink.any(1)):
        if y1 - y0 < _MIN_PANEL_PX:
            continue  # a line of words
        boxes = [(x0, y0, x1, y1) for x0, x1 in _runs(ink[y0:y1].any(0))]
        rows.append([b for b in boxes if b[2] - b[0] >= _MIN_PANEL_PX])
    return rows


class IndexPage(HTMLParser):
    """``index.html`` of a folder of figures: per section its heading, caption, image, the
    caption's scores line ("" when none) and the image's reference captions."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.captions: list[str] = []
        self.images: list[str] = []
        self.scores: list[str] = []
        self.references: list[list[str]] = []
        self._into: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "section":
            self.scores.append("")
            self.references.append([])
        elif tag == "img":
            self.images.append(dict(attrs)["src"] or "")
        elif tag == "h2":
            self._into = self.headings
        elif tag == "p" and ("class", "caption") in attrs:
            self._into = self.captions
        elif tag == "p" and ("class", "scores") in attrs:
            self.scores.pop()
            self._into = self.scores
        elif tag == "li":
            self._into = self.references[-1]

    def handle_data(self, data: str) -> None:
        if self._into is not None:
            self._into.append(data)
            self._into = None


def read_index(folder: Path) -> IndexPage:
    page = IndexPage()
    page.feed((folder / "index.html").read_text(encoding="utf-8"))
    return page
