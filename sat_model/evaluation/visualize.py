"""Attention pictures (Sec. 5.4, Fig. 2-3): one figure per image, and an HTML index of them.

Dimensions: ``T`` words of a caption; ``L = grid_h × grid_w`` annotation locations (row-major);
``H × W`` the pixels of the centre crop the encoder saw (α is defined over that crop, not the
original photo).

A figure is drawn as the paper draws it (Fig. 2-3): the photo, then one panel per word with the
word under it, in rows of ``columns`` panels, each the photo brightened where the model looked
and darkened elsewhere. Each α_t is upsampled to the crop and smoothed with a Gaussian, as the
authors did (upsample ×16, Gaussian blur), and all of an image's panels share one scale (its
largest value), so a word whose α is spread thin shows a dim, even panel and a peaked one a bright
spot: no panel is stretched to its own range. Hard attention is drawn as it decodes: a caption
decoded with ``argmax`` or ``sample`` read one cell s̃_t per word, and that cell is what its panel
brightens; decoded with ``expected`` it read Σ α_i a_i, and its panels show α, as soft ones do.

:class:`AttentionFigures` owns the folder layout (``index.html`` beside ``images/<name>.png``),
for ``sat caption --attention-out`` and the evaluate stage's gallery alike.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Mapping, Sequence
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
    "Attended",
    "AttentionFigures",
    "attended_cells",
    "attention_map",
    "brighten",
    "draw_attention_figure",
    "panel_heats",
]

# the layout of a folder of figures: the page, and the PNGs in a folder of their own (DVC
# declares that folder as image plots: a page is no plot)
INDEX_FILE = "index.html"
FIGURES_DIR = "images"

# the brightness left where α is zero: dark, with the photo still to be made out
_SHADE = 0.15
# a panel's side in inches at _DPI: 2 × 100 px, larger than the 14×14 grid's cells need
_PANEL_INCHES = 2.0
_DPI = 100


def attention_map(
    alpha: np.ndarray, grid_h: int, grid_w: int, size: tuple[int, int], sigma: float | None = None
) -> np.ndarray:
    """α (L,) upsampled and smoothed to (H, W) over an image of ``size = (W, H)``, in α's own
    units (not rescaled: :func:`panel_heats` puts an image's maps on one scale).

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
    return out


def panel_heats(
    alphas: np.ndarray,
    grid_h: int,
    grid_w: int,
    size: tuple[int, int],
    cells: np.ndarray | None = None,
) -> np.ndarray:
    """One image's panels (T, H, W) in [0, 1] on one scale: α_t (T, L) per word, or with
    ``cells`` (T,) the one cell each word read (hard attention's s̃_t), each upsampled and
    smoothed, all divided by the largest value among them."""
    alphas = np.asarray(alphas, dtype=np.float32)
    if cells is not None:
        alphas = np.eye(grid_h * grid_w, dtype=np.float32)[np.asarray(cells)]  # (T, L) one-hot
    maps = np.stack([attention_map(a, grid_h, grid_w, size) for a in alphas])  # (T, H, W)
    top = float(maps.max()) if maps.size else 0.0
    if top <= 0:
        return np.zeros_like(maps)
    heats: np.ndarray = np.clip(maps / top, 0.0, 1.0)
    return heats


def brighten(image: Image.Image, heat: np.ndarray) -> Image.Image:
    """``image`` multiplied by ``heat`` (H, W) in [0, 1]: as it is where heat is 1, darkened
    towards ``_SHADE`` of its brightness where heat is 0 (the paper's figures)."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)  # (H, W, 3)
    if heat.shape != rgb.shape[:2]:
        raise ValueError(f"heat map {heat.shape} does not match the image {rgb.shape[:2]}")
    light = _SHADE + (1.0 - _SHADE) * heat[..., None]  # (H, W, 1)
    return Image.fromarray((rgb * light).round().clip(0, 255).astype(np.uint8))


def attended_cells(
    alphas: np.ndarray, mode: str, locations: np.ndarray | None = None
) -> np.ndarray | None:
    """The cell s̃_t the decoder read for each word (T,): the argmax with ``mode="argmax"``,
    the drawn ``locations`` with ``sample``; None for ``expected`` (every cell, weighted by α)
    and for a draw the caption does not carry."""
    cells: np.ndarray | None = None
    if mode == "argmax":
        cells = np.asarray(alphas).argmax(-1)
    elif mode == "sample" and locations is not None:
        cells = np.asarray(locations)
    return cells


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
    """The PNG of one caption's figure: ``photo`` (the crop α refers to), then per word the
    photo brightened by α_t (T, L), or by the cell read (``cells`` (T,), hard attention's s̃_t),
    on one scale for the image, the word under it, ``columns`` panels a row."""
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
    heats = panel_heats(np.asarray(alphas), grid_h, grid_w, photo.size, cells)  # (T, H, W)
    for t, word in enumerate(words):
        _panel(axes[t + 1], brighten(photo, heats[t]), word)
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


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).strip(".") or "_"


@dataclass(frozen=True)
class _Listed:
    label: str  # what the page calls the image: a photo's path, an image id
    caption: str
    file: str  # the figure, relative to the folder
    references: tuple[str, ...] = ()  # the image's reference captions, when known
    scores: tuple[tuple[str, float], ...] = ()  # the caption's own scores against them


@dataclass(frozen=True)
class Attended:
    """One caption as its figure draws it: the words, α (T, L) over a ``grid_h × grid_w`` map,
    and the cells (T,) a sampling decoder drew (None: it read Σ α a)."""

    words: Sequence[str]
    alphas: np.ndarray
    grid_h: int
    grid_w: int
    locations: np.ndarray | None = None


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
        attended: Attended,
        *,
        references: Sequence[str] = (),
        scores: Mapping[str, float] | None = None,
    ) -> Path:
        """Draw one image's figure as ``images/<stem>.png`` (``stem`` made file-safe, and
        unique with a ``-2``, ``-3``... suffix); ``photo`` is the crop α (T, L) refers to,
        ``attended.locations`` (T,) the cells a sampling decoder drew. The page lists the image's
        ``references`` and the caption's ``scores`` (metric key -> value) beside it."""
        png = draw_attention_figure(
            photo,
            attended.words,
            attended.alphas,
            grid_h=attended.grid_h,
            grid_w=attended.grid_w,
            cells=attended_cells(attended.alphas, self.mode, attended.locations),
            columns=self.columns,
        )
        path = self.folder / FIGURES_DIR / f"{self._unique(_safe_name(stem))}.png"
        write_bytes_atomic(path, png, durable=False)
        listed = _Listed(
            label,
            " ".join(attended.words),
            f"{FIGURES_DIR}/{path.name}",
            tuple(references),
            tuple((scores or {}).items()),
        )
        self._listed.append(listed)
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
        """``index.html``: per image, its name, its caption, the caption's scores, the
        image's reference captions and its figure."""
        page = (
            "<!doctype html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>"
            "img{max-width:100%}.caption{font-size:1.2em}.scores{font-family:monospace}"
            "</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>\n"
            + "\n".join(map(_section, self._listed))
            + "\n</body></html>\n"
        )
        path = self.folder / INDEX_FILE
        write_text_atomic(path, page)
        return path


def _section(e: _Listed) -> str:
    """One image's part of the page."""
    parts = [
        f"<section><h2>{html.escape(e.label)}</h2>",
        f'<p class="caption">{html.escape(e.caption)}</p>',
    ]
    if e.scores:
        shown = " · ".join(f"{html.escape(k)} {v:.3f}" for k, v in e.scores)
        parts.append(f'<p class="scores">{shown}</p>')
    if e.references:
        items = "".join(f"<li>{html.escape(r)}</li>" for r in e.references)
        parts.append(f'<ul class="references">{items}</ul>')
    parts.append(f'<img src="{html.escape(e.file)}" alt="{html.escape(e.caption)}"></section>')
    return "\n".join(parts)
