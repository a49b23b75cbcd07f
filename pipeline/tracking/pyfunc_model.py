"""The MLflow pyfunc model, logged "from code": MLflow stores this file, not a pickle.

For users of MLflow's own tools (``mlflow.pyfunc.load_model``, ``mlflow models serve``); ``sat
serve`` does not run it: it loads the checkpoint with the installed ``sat_model`` behind its own
front door (:mod:`pipeline.serving`). Both answer a request through
:class:`sat_model.caption_request.CaptionService`, so rows, limits and reasons are the same.

Input: a DataFrame with a column ``image``: base64 text (line breaks allowed), a ``data:`` URL
or raw bytes; never a file path. Params (optional): ``beam_size`` (1..``serve.max_beam_size``),
``return_attention`` (bool). Output: a DataFrame with ``caption`` and ``error`` (null unless
that row's image was unusable) and, with ``return_attention``, ``attention``: an object
``{"words", "grid_h", "grid_w", "alphas"}`` (nested in the JSON answer, as ``sat serve`` gives
it: MLflow's scoring server writes each row's values as they are, and the logged signature
declares the column an ``Object``). Limits come from the ``serve`` section logged in
the model config (``context.model_config["serve"]``). A refused request is an
``INVALID_PARAMETER_VALUE`` error (HTTP 400); anything unexpected is logged and answered with a
generic error, never exception text of the server.
"""

from __future__ import annotations

import logging
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

__all__ = ["CHECKPOINT_ARTIFACT", "SatCaptionerModel"]

CHECKPOINT_ARTIFACT = "checkpoint"
_logger = logging.getLogger(__name__)


def _serve_limits(model_config: dict[str, Any] | None) -> Any:
    from pipeline.settings import ServeConfig

    raw = dict((model_config or {}).get("serve") or {})
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}  # JSON has no tuple
    return ServeConfig.model_validate(raw)


class SatCaptionerModel(PythonModel):
    """Captions images with a trained Show, Attend and Tell model."""

    def load_context(self, context: Any) -> None:
        from sat_model.caption_request import CaptionService  # torch loads only when serving

        model_config = getattr(context, "model_config", None) or {}
        self.service = CaptionService.from_dir(
            context.artifacts[CHECKPOINT_ARTIFACT],
            _serve_limits(model_config),
            model_config.get("decode") or {},  # as the model was evaluated
        )

    # a DataFrame hint: MLflow derives no schema from it (the signature logged with the model is
    # the schema) and, unlike no hint at all, warns about nothing each time the model loads
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        from sat_model.caption_request import RequestError

        params = params or {}
        try:
            rows = self.service.caption_rows(
                _image_column(model_input),
                params.get("beam_size"),
                bool(params.get("return_attention")),
            )
        except RequestError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        except Exception:  # a bug or an exhausted machine: the client learns no server detail
            _logger.exception("captioning failed")
            raise MlflowException(
                "internal error while captioning; the server log has the details",
                error_code=INTERNAL_ERROR,
            ) from None
        # object columns keep None: JSON null, not NaN (which strict JSON parsers refuse)
        return pd.DataFrame(rows, dtype=object)


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


mlflow.models.set_model(SatCaptionerModel())
