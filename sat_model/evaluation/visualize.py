"""Attention pictures (Sec. 5.4): one overlay per generated word, and a static HTML gallery.

Dimensions: ``L = grid_h × grid_w`` annotation locations (row-major); ``H × W`` the pixels of the
centre crop the encoder saw (α is defined over that crop, not the original photo).

Each α_t is upsampled to the crop and smoothed with a Gaussian, as the authors did
(upsample ×16, Gaussian blur), then drawn over the photo with a colour map.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from sat_model.atomic import write_text_atomic

__all__ = [
    "GalleryEntry",
    "attention_map",
    "overlay",
    "write_gallery",
    "write_word_overlays",
]

# blend weight of the attention colours over the photo
_OVERLAY_OPACITY = 0.6


@dataclass(frozen=True)
class GalleryEntry:
    """One image of the gallery: its crop, its caption and one overlay per word (paths)."""

    image_id: str
    caption: str
    image_file: Path
    words: tuple[str, ...]
    overlay_files: tuple[Path, ...]


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


def _safe_name(word: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", word) or "_"


def write_word_overlays(
    image: Image.Image,
    words: Sequence[str],
    alphas: np.ndarray,
    *,
    grid_h: int,
    grid_w: int,
    out_dir: str | Path,
    stem: str,
) -> list[Path]:
    """Write ``<stem>_<t>_<word>.png`` for every word; ``image`` is the crop α refers to."""
    if len(words) != len(alphas):
        raise ValueError(f"{len(words)} words but {len(alphas)} attention maps")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for t, word in enumerate(words):
        heat = attention_map(np.asarray(alphas[t]), grid_h, grid_w, image.size)
        path = out_dir / f"{_safe_name(stem)}_{t:02d}_{_safe_name(word)}.png"
        overlay(image, heat).save(path)
        paths.append(path)
    return paths


def _figure(src: str, label: str) -> str:
    return (
        f'<figure><img src="{html.escape(src)}" alt="{html.escape(label)}">'
        f"<figcaption>{html.escape(label)}</figcaption></figure>"
    )


def write_gallery(entries: Sequence[GalleryEntry], out_dir: str | Path, title: str) -> Path:
    """Write ``out_dir/index.html``: each image with its caption, then one map per word."""
    out_dir = Path(out_dir)
    sections = []
    for e in entries:
        figures = [_figure(_relative(e.image_file, out_dir), "image")]
        figures += [
            _figure(_relative(f, out_dir), w) for w, f in zip(e.words, e.overlay_files, strict=True)
        ]
        sections.append(
            f'<section id="{html.escape(e.image_id)}"><h2>{html.escape(e.image_id)}: '
            f"{html.escape(e.caption)}</h2>\n" + "\n".join(figures) + "</section>"
        )
    page = (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "figure{display:inline-block;margin:4px;text-align:center}"
        "img{width:160px;height:160px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    path = out_dir / "index.html"
    write_text_atomic(path, page)
    return path


def _relative(path: Path, base: Path) -> str:
    try:
        return Path(path).resolve().relative_to(base.resolve()).as_posix()
    except ValueError:  # outside the gallery folder: keep it reachable
        return Path(path).resolve().as_uri()
