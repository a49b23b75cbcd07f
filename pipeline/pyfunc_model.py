"""The MLflow pyfunc model, logged "from code": MLflow stores this file, not a pickle.

Input: a DataFrame with a column ``image``: a file path (on the serving machine), base64 text, a
``data:`` URL, or raw bytes. Params (optional): ``beam_size`` (int), ``return_attention`` (bool).
Output: a DataFrame with ``caption`` and ``error`` (null unless that row's image was unusable)
and, with ``return_attention``, ``attention``: JSON ``{"words", "grid_h", "grid_w", "alphas"}``.

A request whose every image is unusable raises an ``INVALID_PARAMETER_VALUE`` error, which the
scoring server answers with HTTP 400 and the reasons; in a mixed batch the good rows are
captioned and the bad ones carry their reason.

The model is rebuilt from its artifact ``checkpoint`` (``model.pt`` state dicts, ``config.json``,
``vocab.json``) by :class:`sat_model.captioner.Captioner`, which rebuilds the frozen encoder
from its recorded description (weights from installed packages, checksum verified).
"""

from __future__ import annotations

import json
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

__all__ = ["CHECKPOINT_ARTIFACT", "SatCaptionerModel"]

CHECKPOINT_ARTIFACT = "checkpoint"


class SatCaptionerModel(mlflow.pyfunc.PythonModel):
    """Captions images with a trained Show, Attend and Tell model."""

    def load_context(self, context: Any) -> None:
        from sat_model.captioner import Captioner  # torch loads only in the serving process

        self.captioner = Captioner.from_dir(context.artifacts[CHECKPOINT_ARTIFACT])

    # no type hints on predict: MLflow would try to derive a (list-only) schema from them; the
    # signature logged with the model is the schema
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        from sat_model.captioner import decode_image_input
        from sat_model.images import ImageError

        params = params or {}
        values = _image_column(model_input)
        images, errors = {}, {}
        for i, value in enumerate(values):
            try:
                images[i] = decode_image_input(value)
            except ImageError as e:
                errors[i] = f"row {i}: not a usable image ({e})"
        if not images:
            raise MlflowException("; ".join(errors.values()), error_code=INVALID_PARAMETER_VALUE)
        beam = params.get("beam_size")
        results = dict(
            zip(images, self.captioner.caption(list(images.values()), beam), strict=True)
        )
        return _frame(len(values), results, errors, bool(params.get("return_attention")))


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
    return json.dumps(
        {"words": list(result.words), "grid_h": result.grid_h, "grid_w": result.grid_w,
         "alphas": alphas}
    )  # fmt: skip


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
    return pd.DataFrame(rows)


mlflow.models.set_model(SatCaptionerModel())
