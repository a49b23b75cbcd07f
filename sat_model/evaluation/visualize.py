"""Attention pictures (Sec. 5.4, Fig. 2-3): one figure per image, and an HTML index of them.

Dimensions: ``T`` words of a caption; ``L = grid_h × grid_w`` annotation locations (row-major);
``H × W`` the pixels of the centre crop the encoder saw (α is defined over that crop, not the
original photo).

A figure is drawn as the paper draws it: the photo, then one panel per word, α_t over the photo
with the word under it, in rows of ``columns`` panels. Each α_t is upsampled to the crop and
smoothed with a Gaussian, as the authors did (upsample ×16, Gaussian blur), then drawn over the
photo with a colour map. Hard attention decoded with ``argmax`` read one cell per word; that
cell is outlined on top of α_t (``mode="sample"`` draws its cell inside the decoder and keeps
only α, so its panels show the distribution the cell was drawn from).

:class:`AttentionFigures` owns the folder layout (``index.html`` beside ``images/<name>.png``),
for ``sat caption --attention-out`` and the evaluate stage's gallery alike.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from sat_model.atomic import write_bytes_atomic, write_text_atomic

__all__ = [
    "FIGURES_DIR",
    "INDEX_FILE",
    "AttentionFigures",
    "attended_cells",
    "attention_map",
    "draw_attention_figure",
    "overlay",
]

# the layout of a folder of figures: the page, and the PNGs in a folder of their own (DVC
# declares that folder as image plots: a page is no plot)
INDEX_FILE = "index.html"
FIGURES_DIR = "images"

# blend weight of the attention colours over the photo
_OVERLAY_OPACITY = 0.6
# a panel's side in inches at _DPI: 2 × 100 px, larger than the 14×14 grid's cells need
_PANEL_INCHES = 2.0
_DPI = 100


def attention_map(
    alpha: np.ndarray, grid_h: int, grid_w: int, size: tuple[int, int], sigma: float | None = None
) -> np.ndarray:
    """α (L,) as a smooth (H, W) map in [0, 1] over an image of ``size = (W, H)``.

    ``sigma`` (pixels) defaults to half a grid cell, which keeps the peak inside its cell while
    hiding the blocky grid.
    """
    if alpha.shape != (grid_h * grid_w,):
        raise ValueError(f"alpha has shape {alpha.shape}, expected ({grid_h * grid_w},)")
    width, height = size
    grid = torch.as_tensor(alpha, dtype=torch.float32).reshape(1, 1, grid_h, grid_w)  # (1,1,h,w)
    up = F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)
    if sigma is None:
        sigma = 0.5 * min(height / grid_h, width / grid_w)
    kernel = 2 * int(3 * sigma) + 1  # ±3σ covers the Gaussian
    smooth = TF.gaussian_blur(up, kernel_size=[kernel, kernel], sigma=[sigma, sigma])
    out: np.ndarray = smooth[0, 0].numpy()  # (H, W)
    span = float(out.max() - out.min())
    # uniform α has no focus to show; rounding noise must not be stretched into one
    if span <= 1e-4 * max(float(np.abs(out).max()), 1e-12):
        return np.zeros_like(out)
    scaled: np.ndarray = (out - out.min()) / span
    return scaled


def overlay(image: Image.Image, heat: np.ndarray, cmap: str = "jet") -> Image.Image:
    """``heat`` (H, W) in [0, 1] drawn over ``image`` (same size) with a matplotlib colour map."""
    from matplotlib import colormaps  # heavy: only for pictures

    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (H, W, 3)
    if heat.shape != rgb.shape[:2]:
        raise ValueError(f"heat map {heat.shape} does not match the image {rgb.shape[:2]}")
    colours = colormaps[cmap](heat)[..., :3]  # (H, W, 3)
    alpha = _OVERLAY_OPACITY * heat[..., None]  # strong attention, strong colour
    mixed = (1 - alpha) * rgb + alpha * colours
    return Image.fromarray((mixed * 255).round().astype(np.uint8))


def attended_cells(alphas: np.ndarray, mode: str) -> np.ndarray | None:
    """The cell s̃_t the decoder read for each word (T,), where α alone tells it: the argmax
    with ``mode="argmax"``; None for ``expected`` (every cell, weighted by α) and for ``sample``
    (a draw the decoder does not keep)."""
    return np.asarray(alphas).argmax(-1) if mode == "argmax" else None


def draw_attention_figure(
    photo: Image.Image,
    words: Sequence[str],
    alphas: np.ndarray,
    *,
    grid_h: int,
    grid_w: int,
    cells: np.ndarray | None = None,
    columns: int = 5,
) -> bytes:
    """The PNG of one caption's figure: ``photo`` (the crop α refers to), then α_t (T, L) over
    it per word with the word under it, ``columns`` panels a row; ``cells`` (T,) outlines the
    cell read per word (hard attention's s̃_t)."""
    from matplotlib.figure import Figure  # heavy: only for pictures; no pyplot, no GUI backend

    if len(words) != len(alphas):
        raise ValueError(f"{len(words)} words but {len(alphas)} attention maps")
    panels = len(words) + 1  # the photo, then a panel per word
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(cols * _PANEL_INCHES, rows * (_PANEL_INCHES + 0.35)), dpi=_DPI)
    axes = fig.subplots(rows, cols, squeeze=False).flat
    for ax in axes:
        ax.set_axis_off()  # the panels past the last word stay blank
    _panel(axes[0], photo, "")
    for t, word in enumerate(words):
        heat = attention_map(np.asarray(alphas[t]), grid_h, grid_w, photo.size)
        ax = axes[t + 1]
        _panel(ax, overlay(photo, heat), word)
        if cells is not None:
            _outline_cell(ax, int(cells[t]), grid_h, grid_w, photo.size)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.99, bottom=0.01, wspace=0.05, hspace=0.2)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight", pad_inches=0.1)  # the last words too
    return buffer.getvalue()


def _panel(ax, image: Image.Image, word: str) -> None:  # type: ignore[no-untyped-def]
    """An image in a thin frame (each panel a closed rectangle), the word under it."""
    ax.set_axis_on()
    ax.imshow(np.asarray(image.convert("RGB")))
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_linewidth(0.5)
        spine.set_color("0.6")
    ax.set_xlabel(word, fontsize=12)


def _outline_cell(ax, cell: int, grid_h: int, grid_w: int, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    from matplotlib.patches import Rectangle

    width, height = size
    row, col = divmod(cell, grid_w)
    cell_w, cell_h = width / grid_w, height / grid_h
    ax.add_patch(
        Rectangle((col * cell_w - 0.5, row * cell_h - 0.5), cell_w, cell_h, fill=False, ec="white")
    )


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).strip(".") or "_"


@dataclass(frozen=True)
class _Listed:
    label: str  # what the page calls the image: a photo's path, an image id
    caption: str
    file: str  # the figure, relative to the folder


class AttentionFigures:
    """A folder of attention figures: ``images/<stem>.png`` per image and ``index.html``
    listing each figure under its image's name and caption.

    Use it as a context manager: :meth:`add` draws one image's figure as it comes, and leaving
    the block (Ctrl-C included) writes the page for the figures drawn. ``mode`` is how the
    captions were decoded (it tells which cells hard attention read, :func:`attended_cells`).
    """

    def __init__(
        self, folder: str | Path, title: str, *, mode: str = "expected", columns: int = 5
    ) -> None:
        self.folder = Path(folder)
        self.title = title
        self.mode = mode
        self.columns = columns
        self._listed: list[_Listed] = []
        self._stems: set[str] = set()

    def __enter__(self) -> Self:
        (self.folder / FIGURES_DIR).mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.write_index()

    def add(
        self,
        label: str,
        stem: str,
        photo: Image.Image,
        words: Sequence[str],
        alphas: np.ndarray,
        *,
        grid_h: int,
        grid_w: int,
    ) -> Path:
        """Draw one image's figure as ``images/<stem>.png`` (``stem`` made file-safe, and
        unique with a ``-2``, ``-3``... suffix); ``photo`` is the crop α (T, L) refers to."""
        png = draw_attention_figure(
            photo,
            words,
            alphas,
            grid_h=grid_h,
            grid_w=grid_w,
            cells=attended_cells(alphas, self.mode),
            columns=self.columns,
        )
        path = self.folder / FIGURES_DIR / f"{self._unique(_safe_name(stem))}.png"
        write_bytes_atomic(path, png, durable=False)
        self._listed.append(_Listed(label, " ".join(words), f"{FIGURES_DIR}/{path.name}"))
        return path

    def __len__(self) -> int:
        """The figures drawn so far."""
        return len(self._listed)

    def _unique(self, stem: str) -> str:
        name, k = stem, 1
        while name in self._stems:
            k += 1
            name = f"{stem}-{k}"
        self._stems.add(name)
        return name

    def write_index(self) -> Path:
        """``index.html``: per image, its name, its caption and its figure."""
        sections = [
            f"<section><h2>{html.escape(e.label)}</h2>\n"
            f'<p class="caption">{html.escape(e.caption)}</p>\n'
            f'<img src="{html.escape(e.file)}" alt="{html.escape(e.caption)}"></section>'
            for e in self._listed
        ]
        page = (
            "<!doctype html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>"
            "img{max-width:100%}.caption{font-size:1.2em}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>\n" + "\n".join(sections) + "\n</body></html>\n"
        )
        path = self.folder / INDEX_FILE
        write_text_atomic(path, page)
        return path
