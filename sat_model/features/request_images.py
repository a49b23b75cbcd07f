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
from typing import Any

import torch

from sat_model.features.images import ImageError, Preprocessing

__all__ = ["MEDIA_TYPES", "NOT_AN_IMAGE", "request_bytes", "request_pixels", "value_size"]

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


def request_bytes(value: Any, formats: tuple[str, ...]) -> bytes:
    """The image bytes a request value carries (raw, base64 or a ``data:`` URL of one of
    ``formats``); nothing is decoded yet.

    Raises:
        ImageError: a value that carries no image bytes.
    """
    if _missing(value):
        raise ImageError("<request>", "empty value")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        text = value.strip()
        if text[:5].lower() == "data:":
            return _data_url_bytes(text, formats)
        return _base64_bytes(text)
    raise ImageError("<request>", NOT_AN_IMAGE)


def request_pixels(value: Any, prep: Preprocessing) -> torch.Tensor:
    """One request value as the encoder's uint8 pixels (3, S, S): its bytes through
    :meth:`Preprocessing.pixels`, the path every photo takes (``prep`` carries the ``serve``
    limits: pixels, formats).

    Raises:
        ImageError: a value that is not an image in an accepted format within the limits.
    """
    return prep.pixels(request_bytes(value, prep.formats), label="<request>")
