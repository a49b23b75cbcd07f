"""The MLflow pyfunc model, logged "from code": MLflow stores this file, not a pickle.

Input: a DataFrame with a column ``image``: base64 text (line breaks allowed), a ``data:`` URL
(``data:image/jpeg;base64,...``) or raw bytes; never a file path (the file system of the
serving machine is never read). Params (optional): ``beam_size`` (1..``serve.max_beam_size``),
``return_attention`` (bool). Output: a DataFrame with ``caption`` and ``error`` (null unless
that row's image was unusable) and, with ``return_attention``, ``attention``: JSON
``{"words", "grid_h", "grid_w", "alphas"}``.

Limits come from the ``serve`` params section (:class:`sat_model.config.ServeConfig`): its
defaults travel with the model (``sat_model`` is logged as code); ``sat serve`` passes the
project's ``serve`` section through MLflow's model config (``context.model_config["serve"]``).
A request over ``max_rows`` rows or ``max_request_bytes`` of image data, or with a bad
``beam_size``, is refused whole (HTTP 400) before any image is decoded. Rows are decoded,
encoded and captioned ``batch_size`` at a time, each image cut to the square the encoder sees
as soon as it is decoded, so memory does not grow with the request. A row that is not a usable
image gets its reason in ``error``; a request with no usable row is answered 400 with the
reasons. No exception text of the server (paths, tracebacks) reaches a client: anything
unexpected is logged on the server and answered with a generic 500.

The model is rebuilt from its artifact ``checkpoint`` (``model.pt`` state dicts, ``config.json``,
``vocab.json``) by :class:`sat_model.captioner.Captioner`, which rebuilds the frozen encoder
from its recorded description (weights from installed packages, checksum verified).
"""

from __future__ import annotations

import json
import logging
import numbers
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

__all__ = ["CHECKPOINT_ARTIFACT", "SatCaptionerModel"]

CHECKPOINT_ARTIFACT = "checkpoint"
_SHOWN_ERRORS = 10  # row reasons quoted in a 400; the rest are counted
_logger = logging.getLogger(__name__)


def _bad_request(message: str) -> MlflowException:
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def _serve_limits(model_config: dict[str, Any] | None) -> Any:
    from sat_model.config import ServeConfig

    raw = dict((model_config or {}).get("serve") or {})
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}  # JSON has no tuple
    return ServeConfig.model_validate(raw)


class SatCaptionerModel(PythonModel):
    """Captions images with a trained Show, Attend and Tell model."""

    def load_context(self, context: Any) -> None:
        from sat_model.captioner import Captioner  # torch loads only in the serving process
        from sat_model.features.request_images import ImageLimits

        self.serve = _serve_limits(getattr(context, "model_config", None))
        self.image_limits = ImageLimits(self.serve.max_image_pixels, self.serve.formats)
        model_config = getattr(context, "model_config", None) or {}
        self.captioner = Captioner.from_dir(
            context.artifacts[CHECKPOINT_ARTIFACT],
            batch_size=self.serve.batch_size,
            **(model_config.get("decode") or {}),  # as the model was evaluated
        )

    # no type hints on predict: MLflow would try to derive a (list-only) schema from them; the
    # signature logged with the model is the schema
    def predict(self, context, model_input, params=None):
        try:
            return self._predict(model_input, params or {})
        except MlflowException:
            raise
        except Exception:  # a bug or an exhausted machine: the client learns no server detail
            _logger.exception("captioning failed")
            raise MlflowException(
                "internal error while captioning; the server log has the details",
                error_code=INTERNAL_ERROR,
            ) from None

    def _predict(self, model_input: Any, params: dict[str, Any]) -> pd.DataFrame:
        values = _image_column(model_input)
        _check_request(values, self.serve)
        beam = _beam_size(params.get("beam_size"), self.serve.max_beam_size)
        results, errors = self._caption_rows(values, beam)
        if not results:
            shown = list(errors.values())[:_SHOWN_ERRORS]
            more = len(errors) - len(shown)
            raise _bad_request(
                "no usable image in the request: "
                + "; ".join(shown)
                + (f"; and {more} more" if more else "")
            )
        return _frame(len(values), results, errors, bool(params.get("return_attention")))

    def _caption_rows(
        self, values: list[Any], beam: int | None
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Decode, encode and caption ``batch_size`` rows at a time."""
        from sat_model.features.images import ImageError
        from sat_model.features.request_images import decode_request_image

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        step = self.serve.batch_size
        for start in range(0, len(values), step):
            batch = {}
            for i in range(start, min(start + step, len(values))):
                try:
                    batch[i] = decode_request_image(
                        values[i],
                        self.image_limits,
                        side=self.captioner.resize,
                        keep_aspect=self.captioner.keep_aspect,
                    )
                except ImageError as e:
                    errors[i] = f"row {i}: {e.reason}"
            if batch:
                captions = self.captioner.caption(list(batch.values()), beam)
                results.update(zip(batch, captions, strict=True))
        return results, errors


def _check_request(values: list[Any], serve: Any) -> None:
    """Refuse a request over the row or byte limits before any image is decoded."""
    from sat_model.features.request_images import value_size

    if not values:
        raise _bad_request("the request holds no rows")
    if len(values) > serve.max_rows:
        raise _bad_request(
            f"too many rows: {len(values)} images in one request, serve.max_rows is "
            f"{serve.max_rows}; split the request"
        )
    size = sum(value_size(v) for v in values)
    if size > serve.max_request_bytes:
        raise _bad_request(
            f"request too large: {size} bytes of image data, serve.max_request_bytes is "
            f"{serve.max_request_bytes}; split the request or send smaller images"
        )


def _beam_size(value: Any, max_beam: int) -> int | None:
    """``beam_size`` as given (None: the model's own), refused outside 1..max_beam."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not 1 <= int(value) <= max_beam
    ):
        shown = repr(value)[:20]
        raise _bad_request(f"beam_size must be an integer in 1..{max_beam}, got {shown}")
    return int(value)


def _image_column(model_input: Any) -> list[Any]:
    if isinstance(model_input, pd.DataFrame):
        if "image" not in model_input.columns:
            raise MlflowException(
                f"input needs a column 'image', got {list(model_input.columns)}",
                error_code=INVALID_PARAMETER_VALUE,
            )
        return list(model_input["image"])
    if isinstance(model_input, dict) and "image" in model_input:
        value = model_input["image"]
        return list(value) if isinstance(value, list | tuple) else [value]
    if isinstance(model_input, list | tuple):
        return list(model_input)
    return [model_input]


def _attention_json(result: Any) -> str:
    alphas = [[round(float(a), 5) for a in step] for step in result.alphas]  # (len, L)
    doc = {"words": list(result.words), "grid_h": result.grid_h, "grid_w": result.grid_w}
    return json.dumps({**doc, "alphas": alphas})


def _frame(
    n: int, results: dict[int, Any], errors: dict[int, str], attention: bool
) -> pd.DataFrame:
    rows = []
    for i in range(n):
        r = results.get(i)
        row: dict[str, Any] = {"caption": r.text if r else None, "error": errors.get(i)}
        if attention:
            row["attention"] = _attention_json(r) if r else None
        rows.append(row)
    # object columns keep None: JSON null, not NaN (which strict JSON parsers refuse)
    return pd.DataFrame(rows, dtype=object)


mlflow.models.set_model(SatCaptionerModel())
