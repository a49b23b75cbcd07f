"""The promotion floor: the least test score a version needs before it may become ``champion``.

``promotion.floor`` names a minimum per metric. A version below any of them is still
registered, but ``champion`` does not move to it, neither in the register stage nor by
``sat promote``, unless someone overrides the floor on purpose (``sat promote --version N
--override-floor --reason TEXT``): the reason and the scores that missed are recorded on the
version as tags, where ``sat models`` and the model card show them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a client is passed in: checking a floor needs no MLflow
    from mlflow import MlflowClient

__all__ = [
    "FLOOR_MISSED_TAG",
    "FLOOR_OVERRIDE_TAG",
    "check_floor",
    "floor_misses",
    "record_override",
]

FLOOR_OVERRIDE_TAG = "sat.floor_override"  # on a version promoted below the floor: the reason
FLOOR_MISSED_TAG = "sat.floor_override.missed"  # ... and what it missed


def check_floor(floor: Mapping[str, float]) -> None:
    """Refuse a floor on a metric that evaluation does not write (:class:`ParamsError`, the key
    named): a misspelt metric would otherwise keep every version from ``champion``. Checked
    here, where the floor is used, so that the library's settings import no metric."""
    from sat_model.config import ParamsError
    from sat_model.evaluation.metrics import metric_keys

    known = {*metric_keys(), "pointing_accuracy"}
    for metric in floor:
        if metric not in known:
            raise ParamsError(
                f"promotion.floor.{metric}: not a metric evaluation writes ({sorted(known)})"
            )


def floor_misses(metrics: Mapping[str, float], floor: Mapping[str, float]) -> list[str]:
    """One phrase per metric of ``floor`` that ``metrics`` does not reach, in ``floor``'s order;
    a metric that is absent or NaN misses too (nothing shows it passes)."""
    misses = []
    for metric, minimum in floor.items():
        value = metrics.get(metric)
        if value is None or math.isnan(value):
            misses.append(f"{metric} has no value (floor {minimum:.4f})")
        elif value < minimum:
            misses.append(f"{metric} {value:.4f} is below the floor {minimum:.4f}")
    return misses


def record_override(
    client: MlflowClient, model_name: str, version: str, reason: str, misses: Sequence[str]
) -> None:
    """Tag ``version`` with why it was promoted below the floor, and what it missed."""
    client.set_model_version_tag(model_name, version, FLOOR_OVERRIDE_TAG, reason)
    client.set_model_version_tag(model_name, version, FLOOR_MISSED_TAG, "; ".join(misses))
