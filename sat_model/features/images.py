"""Image decoding and preprocessing: the one path from bytes to pixels.

Every way a photo enters (the extract stage, ``sat caption`` on either engine, both engines of
``sat serve``) goes through :meth:`Preprocessing.pixels`: decode (a file, or untrusted bytes)
into an upright RGB image, then :meth:`Preprocessing.cut`: shorter side resized to ``resize``,
centre crop (paper, Sec. 3.1.1 and 5: 256 then 224), uint8; the encoder normalises a batch at a
time (:func:`normalize_pixels`, ImageNet mean/std). A JPEG is decoded at a reduced scale
(libjpeg's ``draft``) whose shorter side stays at least ``resize``: the same reduction on every
path, so the same bytes give the same pixels, and a request's memory is bounded by its pixels
(3 x crop x crop bytes an image) as soon as it is decoded. ``load_image`` and
:func:`decode_image_bytes` raise :class:`ImageError` with a reason fit for a skip report.

``keep_aspect=False`` resizes both sides to ``resize`` instead (the aspect ratio is not kept),
then centre-crops as before: with ``resize == crop`` the encoder sees the whole photo, squeezed
into a square. That is how the photos of a dataset distributed already squeezed were made
(Flickr8k's here: every train photo 224×224), so a photo of another shape meets the encoder as
the training photos did, and nothing at its edges is cut away (``encoder.keep_aspect``).
"""

from __future__ import annotations

import io
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from sat_model.features.formats import FILE_FORMATS

__all__ = [
    "FILE_FORMATS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageError",
    "Preprocessing",
    "decode_image_bytes",
    "encoder_view",
    "load_image",
    "normalize_pixels",
    "preprocess",
    "resize_crop",
    "to_picture",
    "to_rgb",
]

# _TORCHVISION: torchvision is imported where pixels are made, not with this module: importing it
# costs a second of CPU (it pulls in torch._dynamo), and every params load imports this module
# through the encoder registry.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Alpha is composited on white: captioning datasets photograph objects, and a transparent
# background of a cut-out is almost always meant as "paper", not as black.
_BACKGROUND = (255, 255, 255)


class ImageError(ValueError):
    """An image that cannot be used; ``reason`` is a short phrase for a skip report."""

    def __init__(self, path: str | Path | IO[bytes], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


def _composite_on_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*_BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _high_bit_depth_to_l(image: Image.Image) -> Image.Image:
    """Map a 16-bit, 32-bit integer or float grey image onto 8 bits by scaling, not clipping.

    ``I;16*`` and ``I`` are read as 16-bit samples (the only common files Pillow opens as ``I`` are
    16-bit PNG/TIFF): 0..65535 → 0..255, i.e. x / 257. ``F`` is taken as [0, 1] when its maximum
    is at most 1, else as [0, 255]; values outside the range saturate.
    """
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        scale = 255.0 if np.nanmax(values, initial=0.0) <= 1.0 else 1.0
        scaled = np.nan_to_num(values) * scale
    else:
        scaled = values / 257.0
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))  # mode L


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB (alpha composited on white; high bit depths scaled)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I") or mode == "F":
        return _high_bit_depth_to_l(image).convert("RGB")
    if mode == "P":
        has_alpha = "transparency" in image.info or (
            image.palette is not None and image.palette.mode == "RGBA"
        )
        return _composite_on_white(image) if has_alpha else image.convert("RGB")
    if "A" in mode or "a" in mode:  # LA, La, RGBA, RGBa, PA
        return _composite_on_white(image)
    return image.convert("RGB")  # 1, L, CMYK, YCbCr, LAB, HSV, RGBX


def _check_size(
    image: Image.Image,
    path: str | Path | IO[bytes],
    max_pixels: int,
    setting: str = "encoder.max_image_pixels",
) -> None:
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            path,
            f"decompression bomb guard: {width}x{height} = {width * height} pixels "
            f"exceeds {setting} = {max_pixels}",
        )
    if width == 0 or height == 0:
        raise ImageError(path, f"empty image ({width}x{height})")


def _draft_for_resize(image: Image.Image, min_side: int) -> None:
    # JPEG only: let libjpeg decode at 1/2, 1/4 or 1/8 scale while the shorter side stays at least
    # min_side; the resize that follows is then much cheaper (output changes slightly).
    width, height = image.size
    scale = min(width, height) / min_side
    if image.format == "JPEG" and scale >= 2:
        image.draft("RGB", (math.ceil(width / scale), math.ceil(height / scale)))


def _decode_opened(
    image: Image.Image,
    label: str | Path | IO[bytes],
    max_pixels: int,
    min_side: int | None,
    setting: str = "encoder.max_image_pixels",
) -> Image.Image:
    """An opened (header-only) image decoded, upright, RGB: the one decoding step of files and
    of bytes alike, so the same bytes give the same pixels whichever way they came."""
    _check_size(image, label, max_pixels, setting)
    if min_side is not None:
        _draft_for_resize(image, min_side)
    image.load()
    return to_rgb(ImageOps.exif_transpose(image))


def load_image(
    path: str | Path | IO[bytes], max_pixels: int = 50_000_000, min_side: int | None = None
) -> Image.Image:
    """Decode ``path`` into an upright RGB image.

    Args:
        path: image file (or an open binary stream of one).
        max_pixels: decompression-bomb limit on width × height, checked from the header before
            any pixel is decoded.
        min_side: when given, JPEGs may be decoded at a reduced scale whose shorter side is still
            at least ``min_side`` (use the preprocessing ``resize``).

    Raises:
        ImageError: unreadable, truncated, empty or oversized image (the reason says which).
    """
    with warnings.catch_warnings():
        # the explicit max_pixels check below replaces Pillow's process-wide warning
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path, formats=list(FILE_FORMATS)) as image:
                return _decode_opened(image, path, max_pixels, min_side)
        except ImageError:
            raise
        except Image.DecompressionBombError as e:
            raise ImageError(path, f"decompression bomb guard (Pillow): {e}") from e
        except FileNotFoundError as e:
            raise ImageError(path, "file not found") from e
        except (OSError, SyntaxError, ValueError) as e:
            # PIL raises UnidentifiedImageError (OSError) for unknown formats, OSError for
            # truncated data, SyntaxError/ValueError from some malformed headers.
            raise ImageError(path, f"cannot decode: {type(e).__name__}: {e}") from e


def _sniff_format(prefix: bytes) -> str | None:
    """The Pillow format whose magic bytes ``prefix`` starts with, read without parsing."""
    Image.init()
    for name in Image.ID:
        accept = Image.OPEN[name][1]
        if accept is not None and accept(prefix):
            return name
    return None


def _accepted(image_format: str | None, formats: tuple[str, ...]) -> bool:
    # a JPEG with an embedded second picture (phones) opens as MPO: it is still a JPEG
    return image_format in formats or (image_format == "MPO" and "JPEG" in formats)


def _open_untrusted(data: bytes, formats: tuple[str, ...], label: str) -> Image.Image:
    """Open (header only) with only the parsers of ``formats``; name a refused format."""
    try:
        return Image.open(io.BytesIO(data), formats=list(formats))
    except UnidentifiedImageError:
        found = _sniff_format(data[:16])
        if found is not None and not _accepted(found, formats):
            raise ImageError(
                label, f"{found} images are not accepted (accepted: {', '.join(formats)})"
            ) from None
        raise ImageError(label, "not a recognised image") from None


def decode_image_bytes(
    data: bytes,
    *,
    max_pixels: int,
    formats: tuple[str, ...],
    min_side: int | None = None,
    label: str = "<image>",
    setting: str = "serve.max_image_pixels",
) -> Image.Image:
    """Decode untrusted image bytes into an upright RGB image; nothing reads the file system.

    Only the parsers of ``formats`` (Pillow names: ``JPEG``, ``PNG``, ``WEBP``...) ever see the
    bytes; width x height is checked against ``max_pixels`` from the header before any pixel is
    decoded. Reasons name no file and quote no image content.

    Raises:
        ImageError: refused format, too many pixels, truncated or corrupt data.
    """
    if not data:
        raise ImageError(label, "empty image data")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with _open_untrusted(data, formats, label) as image:
                if not _accepted(image.format, formats):  # a plugin may report another format
                    raise ImageError(label, f"{image.format} images are not accepted")
                return _decode_opened(image, label, max_pixels, min_side, setting)
        except ImageError:
            raise
        except Image.DecompressionBombError:
            raise ImageError(
                label, f"decompression bomb guard: more pixels than {setting} = {max_pixels}"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError, struct.error):
            raise ImageError(label, "truncated or corrupt image data") from None


def encoder_view(
    image: Image.Image, resize: int = 256, crop: int = 224, keep_aspect: bool = True
) -> Image.Image:
    """The ``crop × crop`` picture the encoder sees: the shorter side (or, without
    ``keep_aspect``, both sides) resized to ``resize``, then the centre ``crop × crop``."""
    if crop > resize:
        raise ValueError(f"crop {crop} is larger than resize {resize}")
    from torchvision.transforms import functional as TF  # see _TORCHVISION

    size = [resize] if keep_aspect else [resize, resize]
    resized = TF.resize(image, size, interpolation=TF.InterpolationMode.BILINEAR)
    view: Image.Image = TF.center_crop(resized, [crop, crop])
    return view


def resize_crop(
    image: Image.Image, resize: int = 256, crop: int = 224, keep_aspect: bool = True
) -> torch.Tensor:
    """:func:`encoder_view` as uint8 pixels (3, crop, crop).

    The decoding half of :func:`preprocess`; extraction workers stop here and hand a quarter of
    the bytes of a float image to the process that runs the encoder.
    """
    if image.mode != "RGB":
        raise ValueError(f"preprocess expects an RGB image, got mode {image.mode!r}")
    from torchvision.transforms import functional as TF  # see _TORCHVISION

    pixels: torch.Tensor = TF.pil_to_tensor(encoder_view(image, resize, crop, keep_aspect))
    return pixels  # (3, S, S) uint8


def normalize_pixels(
    pixels: torch.Tensor,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> torch.Tensor:
    """uint8 pixels (..., 3, S, S) → float32 ``(x / 255 - mean) / std``, same shape.

    The same float operations in the same order for one image or a batch, so a batch normalised
    at once equals its images normalised one by one, bit for bit.
    """
    from torchvision.transforms import functional as TF  # see _TORCHVISION

    normalised: torch.Tensor = TF.normalize(pixels.float().div_(255.0), mean, std, inplace=True)
    return normalised


def preprocess(
    image: Image.Image,
    resize: int = 256,
    crop: int = 224,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
    keep_aspect: bool = True,
) -> torch.Tensor:
    """Resize the shorter side (both sides without ``keep_aspect``) to ``resize``, centre-crop
    ``crop``, normalise: (3, crop, crop)."""
    pixels = resize_crop(image, resize, crop, keep_aspect)  # (3, S, S) uint8
    return normalize_pixels(pixels, mean, std)


@dataclass(frozen=True)
class Preprocessing:
    """How a photo becomes the encoder's pixels, the same for every way it enters: the extract
    stage, ``sat caption`` (both engines) and ``sat serve`` (both engines).

    ``max_pixels``, ``formats`` and ``setting`` bound what may be decoded (a served model sets
    them from ``serve``, with ``setting`` the param a refusal names); they never change pixels.
    """

    resize: int
    crop: int
    max_pixels: int = 50_000_000
    mirror: bool = False  # left to right, after the centre crop (the crop of the mirrored photo)
    keep_aspect: bool = True  # resize the shorter side (False: both sides) to ``resize``
    formats: tuple[str, ...] = FILE_FORMATS
    setting: str = "encoder.max_image_pixels"

    def pixels(self, source: str | Path | bytes, label: str = "<image>") -> torch.Tensor:
        """A file (a path) or untrusted bytes decoded and cut: uint8 (3, S, S).

        A JPEG is decoded at the reduced scale whose shorter side is still ``resize`` or more
        (:func:`_draft_for_resize`), on every path alike; ``label`` names bytes in a reason.

        Raises:
            ImageError: unreadable, refused or oversized image (the reason says which).
        """
        if isinstance(source, bytes):
            image = decode_image_bytes(
                source,
                max_pixels=self.max_pixels,
                formats=self.formats,
                min_side=self.resize,
                label=label,
                setting=self.setting,
            )
        else:
            image = load_image(source, max_pixels=self.max_pixels, min_side=self.resize)
        return self.cut(image)

    def cut(self, image: Image.Image) -> torch.Tensor:
        """An RGB image as the encoder sees it (:func:`resize_crop`, mirrored when asked):
        uint8 (3, S, S); normalisation is the encoder's, a batch at a time."""
        pixels = resize_crop(image, self.resize, self.crop, self.keep_aspect)  # (3, S, S) uint8
        return pixels.flip(-1) if self.mirror else pixels


def to_picture(pixels: torch.Tensor) -> Image.Image:
    """uint8 pixels (3, S, S) as the RGB picture they are (what attention figures draw on)."""
    from torchvision.transforms import functional as TF  # see _TORCHVISION

    picture: Image.Image = TF.to_pil_image(pixels)
    return picture
