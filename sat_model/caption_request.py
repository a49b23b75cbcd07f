"""A captioning request: rows of images checked against the serve limits, then captioned.

One owner for what a served model does with a request, whatever carries it (``sat serve``'s
HTTP front door, the MLflow pyfunc model, Ray Serve): the rows, their sizes and the beam are
checked before any image is decoded; each image becomes the encoder's pixels as soon as it is
decoded (:meth:`~sat_model.features.images.Preprocessing.pixels`, the path ``sat caption`` and
the extract stage take), so a request holds at most ``max_rows`` crops of 3 x S x S bytes, and
they are encoded and captioned ``batch_size`` at a time. Several requests may share those batches
(:meth:`CaptionService.caption_prepared`). A row that is not a usable image gets its reason; a
request with no usable row is refused whole with the reasons. Every message is safe to send to
a client: it names no file of the server and quotes no request content.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from sat_model.captioner import Captioner, ImageCaption
from sat_model.features.drift import drift_fields
from sat_model.features.images import ImageError
from sat_model.features.request_images import request_pixels, value_size

__all__ = [
    "CaptionService",
    "PreparedRequest",
    "RequestError",
    "RequestLimits",
    "check_rows",
    "parse_beam_size",
]

_SHOWN_ERRORS = 10  # row reasons quoted when a request is refused; the rest are counted


class RequestLimits(Protocol):
    """The limits a request is held to: the serving settings (``pipeline.settings.RequestLimits``,
    the ``serve`` section of params) carry them."""

    @property
    def max_rows(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_image_pixels(self) -> int: ...
    @property
    def formats(self) -> tuple[str, ...]: ...
    @property
    def max_beam_size(self) -> int: ...
    @property
    def batch_size(self) -> int: ...


class RequestError(ValueError):
    """The request as a whole is refused (HTTP 400); the message is meant for the client."""


def check_rows(values: Sequence[Any], serve: RequestLimits) -> None:
    """Refuse a request over the row or byte limits before any image is decoded."""
    if not values:
        raise RequestError("the request holds no rows")
    if len(values) > serve.max_rows:
        raise RequestError(
            f"too many rows: {len(values)} images in one request, serve.max_rows is "
            f"{serve.max_rows}; split the request"
        )
    size = sum(value_size(v) for v in values)
    if size > serve.max_request_bytes:
        raise RequestError(
            f"request too large: {size} bytes of image data, serve.max_request_bytes is "
            f"{serve.max_request_bytes}; split the request or send smaller images"
        )


def parse_beam_size(value: Any, max_beam: int) -> int | None:
    """``beam_size`` as given (None: the model's own), refused outside 1..max_beam."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not 1 <= int(value) <= max_beam
    ):
        raise RequestError(f"beam_size must be an integer in 1..{max_beam}, got {repr(value)[:20]}")
    return int(value)


def _attention(result: ImageCaption) -> dict[str, Any]:
    alphas = [[round(float(a), 5) for a in step] for step in result.alphas]  # (len, L)
    doc = {"words": list(result.words), "grid_h": result.grid_h, "grid_w": result.grid_w}
    return {**doc, "alphas": alphas}


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked and decoded: its images (row -> the encoder's pixels (3, S, S)
    uint8), the reasons of its unusable rows, and how to caption it."""

    rows: int
    images: dict[int, torch.Tensor]
    errors: dict[int, str]
    beam_size: int | None
    return_attention: bool


class CaptionService:
    """A loaded model and the ``serve`` limits it answers requests under."""

    def __init__(self, captioner: Captioner, serve: RequestLimits) -> None:
        self.captioner = captioner
        self.serve = serve
        self.preprocessing = replace(
            captioner.preprocessing,
            max_pixels=serve.max_image_pixels,
            formats=serve.formats,
            setting="serve.max_image_pixels",
        )

    @classmethod
    def from_dir(
        cls, checkpoint_dir: str | Path, serve: RequestLimits, decode: Mapping[str, Any]
    ) -> CaptionService:
        """The checkpoint folder's model, decoding as ``decode`` says (as it was evaluated)."""
        captioner = Captioner.from_dir(checkpoint_dir, batch_size=serve.batch_size, **decode)
        return cls(captioner, serve)

    def caption_rows(
        self, values: Sequence[Any], beam_size: Any = None, return_attention: bool = False
    ) -> list[dict[str, Any]]:
        """One ``{"caption", "error", "drift", "drifted"[, "attention"]}`` per row, in order;
        ``drift`` is the photo's distance from the training photos' features and ``drifted``
        whether it is past the model's threshold (:mod:`sat_model.features.drift`; null without
        statistics); ``attention`` is ``{"words", "grid_h", "grid_w", "alphas"}`` (one α row
        per word).

        Raises:
            RequestError: over a limit, a bad ``beam_size``, or no usable row.
        """
        (answer,) = self.caption_prepared([self.prepare(values, beam_size, return_attention)])
        if isinstance(answer, RequestError):
            raise answer
        return answer

    def prepare(
        self, values: Sequence[Any], beam_size: Any = None, return_attention: bool = False
    ) -> PreparedRequest:
        """Check a request and decode its rows; :class:`RequestError` if it is refused whole."""
        check_rows(values, self.serve)
        beam = parse_beam_size(beam_size, self.serve.max_beam_size)
        images: dict[int, torch.Tensor] = {}
        errors: dict[int, str] = {}
        for i, value in enumerate(values):
            try:
                images[i] = request_pixels(value, self.preprocessing)
            except ImageError as e:
                errors[i] = f"row {i}: {e.reason}"
        return PreparedRequest(len(values), images, errors, beam, return_attention)

    def caption_prepared(
        self, requests: Sequence[PreparedRequest]
    ) -> list[list[dict[str, Any]] | RequestError]:
        """Caption several requests together: the images of all requests that share a beam go
        through one batched beam search (``batch_size`` at a time). Each request gets its rows,
        or a :class:`RequestError` when none of its rows was usable."""
        captions: dict[tuple[int, int], ImageCaption] = {}
        for beam in dict.fromkeys(r.beam_size for r in requests):
            keys = [(k, i) for k, r in enumerate(requests) if r.beam_size == beam for i in r.images]
            if not keys:
                continue
            pixels = torch.stack([requests[k].images[i] for k, i in keys])  # (B, 3, S, S)
            captions.update(zip(keys, self.captioner.caption_pixels(pixels, beam), strict=True))
        return [_answer(k, r, captions) for k, r in enumerate(requests)]


def _answer(
    k: int, request: PreparedRequest, captions: Mapping[tuple[int, int], ImageCaption]
) -> list[dict[str, Any]] | RequestError:
    if not request.images:
        shown = list(request.errors.values())[:_SHOWN_ERRORS]
        more = len(request.errors) - len(shown)
        return RequestError(
            "no usable image in the request: "
            + "; ".join(shown)
            + (f"; and {more} more" if more else "")
        )
    rows = []
    for i in range(request.rows):
        r = captions.get((k, i))
        row: dict[str, Any] = {"caption": r.text if r else None, "error": request.errors.get(i)}
        row |= drift_fields(r.drift if r else None)
        if request.return_attention:
            row["attention"] = _attention(r) if r else None
        rows.append(row)
    return rows
