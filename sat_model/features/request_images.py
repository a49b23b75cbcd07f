"""Images as a request carries them: raw bytes, base64 text or a ``data:`` URL; never a path.

The served model decodes request values here. A value's kind is told from its form alone: the
file system is never asked (a string that is neither base64 nor a ``data:`` URL is refused,
whatever file it might name). Reasons are short, name no file of the server and quote no image
content; :class:`~sat_model.features.images.ImageError` carries them.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from typing import Any

from PIL import Image

from sat_model.features.formats import REQUEST_FORMATS
from sat_model.features.images import ImageError, decode_image_bytes, square_thumbnail

__all__ = ["MEDIA_TYPES", "NOT_AN_IMAGE", "ImageLimits", "decode_request_image", "value_size"]

NOT_AN_IMAGE = "not an image: expected base64 or a data: URL"
# the media type a data: URL must declare for each Pillow format (when serve.formats has it)
MEDIA_TYPES = {
    "JPEG": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
}
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),", re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    """What one request image may be (``serve`` params)."""

    max_pixels: int = 16_000_000
    formats: tuple[str, ...] = REQUEST_FORMATS


def value_size(value: Any) -> int:
    """Bytes a request value occupies as received (0 for a missing one)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, str):
        return len(value)
    return 0


def _base64_bytes(text: str) -> bytes:
    # line breaks and 76-column wrapping (MIME, `base64` without -w0) are not part of the data
    compact = "".join(text.split())
    if not compact:
        raise ImageError("<request>", "empty value")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("<request>", NOT_AN_IMAGE) from None


def _data_url_bytes(text: str, formats: tuple[str, ...]) -> bytes:
    """The bytes of ``data:image/png;base64,...`` whose media type is an accepted format's."""
    match = _DATA_URL.match(text)
    if match is None:
        raise ImageError("<request>", "malformed data: URL")
    media_type = match["type"].strip().lower()
    accepted = {MEDIA_TYPES[f]: f for f in formats if f in MEDIA_TYPES}
    if media_type not in accepted:
        shown = media_type[:40] or "none"
        raise ImageError(
            "<request>",
            f"data: URL media type {shown!r} is not accepted "
            f"(accepted: {', '.join(sorted(accepted))})",
        )
    if ";base64" not in match["params"].lower():
        raise ImageError("<request>", "data: URL is not base64-encoded (needs ';base64,')")
    return _base64_bytes(text[match.end() :])


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def decode_request_image(
    value: Any, limits: ImageLimits, side: int | None = None, keep_aspect: bool = True
) -> Image.Image:
    """One request value as an RGB image; with ``side``, the part the encoder sees at side x
    side: its centred square, or the whole image without ``keep_aspect`` (``square_thumbnail``).

    Raises:
        ImageError: a value that is not an image in an accepted format within the limits.
    """
    if _missing(value):
        raise ImageError("<request>", "empty value")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        text = value.strip()
        if text[:5].lower() == "data:":
            data = _data_url_bytes(text, limits.formats)
        else:
            data = _base64_bytes(text)
    else:
        raise ImageError("<request>", NOT_AN_IMAGE)
    image = decode_image_bytes(
        data,
        max_pixels=limits.max_pixels,
        formats=limits.formats,
        min_side=side,
        label="<request>",
    )
    return square_thumbnail(image, side, keep_aspect) if side is not None else image
