"""The seeds of a registered version: the versions that differ from it only in ``train.seed``.

Their scores give the spread the model card and ``sat review`` show: a difference between two
versions means little when it is smaller than what another seed alone changes. Two versions are
the same model but for the seed when they share the attention variant, the data (the dvc.lock
hashes of the prepared data and the features), the decoding, and every logged param but
``train.seed``.
"""

from __future__ import annotations

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from pipeline.tracking.runs import ATTENTION_TAG

__all__ = ["seed_scores"]

SEED_PARAM = "train.seed"
_SAME = (ATTENTION_TAG, "sat.prepared_md5", "sat.features_md5", "sat.decoding")


def _identity(client: MlflowClient, version: ModelVersion) -> tuple[object, ...] | None:
    if not version.run_id:
        return None
    params = dict(client.get_run(version.run_id).data.params)
    params.pop(SEED_PARAM, None)
    return (*(version.tags.get(t) for t in _SAME), tuple(sorted(params.items())))


def seed_scores(client: MlflowClient, model_name: str, version: str) -> dict[str, dict[str, float]]:
    """``{seed: test metrics}`` of ``version`` and of every version that differs from it only
    in ``train.seed`` (one entry per seed: the newest version of a seed)."""
    base = client.get_model_version(model_name, version)
    key = _identity(client, base)
    if key is None:
        return {}
    found: dict[str, dict[str, float]] = {}
    versions = client.search_model_versions(f"name = '{model_name}'")
    for v in sorted(versions, key=lambda v: int(v.version)):
        if v.run_id and _identity(client, v) == key:
            run = client.get_run(v.run_id)
            found[run.data.params.get(SEED_PARAM, "?")] = dict(run.data.metrics)
    return found
