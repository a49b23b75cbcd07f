"""Image decoding and preprocessing shared by feature extraction, ``sat caption`` and serving.

``load_image`` turns a file into an upright RGB ``PIL.Image`` or raises :class:`ImageError` with a
reason fit for a skip report; ``preprocess`` turns that image into the encoder's input tensor
``(3, crop, crop)``: shorter side resized to ``resize``, centre crop, per-channel normalisation
(paper, Sec. 3.1.1 and 5: 256 then 224, ImageNet mean/std).

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
    "decode_image_bytes",
    "encoder_view",
    "load_image",
    "normalize_pixels",
    "preprocess",
    "resize_crop",
    "square_thumbnail",
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
                _check_size(image, path, max_pixels)
                if min_side is not None:
                    _draft_for_resize(image, min_side)
                image.load()
                upright = ImageOps.exif_transpose(image)
                return to_rgb(upright)
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
                _check_size(image, label, max_pixels, setting)
                if min_side is not None:
                    _draft_for_resize(image, min_side)
                image.load()
                return to_rgb(ImageOps.exif_transpose(image))
        except ImageError:
            raise
        except Image.DecompressionBombError:
            raise ImageError(
                label, f"decompression bomb guard: more pixels than {setting} = {max_pixels}"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError, struct.error):
            raise ImageError(label, "truncated or corrupt image data") from None


def square_thumbnail(image: Image.Image, side: int, keep_aspect: bool = True) -> Image.Image:
    """The part of ``image`` that :func:`preprocess` with ``resize=side`` uses, at side x side
    (bilinear): its centred square, or the whole image when ``keep_aspect`` is false.

    A size that no longer depends on the input: a 16-megapixel photo (or a 16,000,000 x 1 strip)
    becomes side².
    """
    width, height = image.size
    if not keep_aspect:
        return image.resize((side, side), Image.Resampling.BILINEAR)
    s = min(width, height)
    left, top = (width - s) // 2, (height - s) // 2
    return image.resize((side, side), Image.Resampling.BILINEAR, box=(left, top, left + s, top + s))


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
