"""Lineage: what a run or a registered version was built from, in one tag vocabulary.

MLflow's own ``mlflow.source.git.commit``, and ``sat.*`` for the rest (``sat.attention``,
``sat.checkpoint_sha256``, ``sat.prepared_md5``, ``sat.features_md5``, ``sat.dvc_experiment``).
The prepared data and the features are also logged as MLflow dataset inputs whose digest is
their DVC hash from ``dvc.lock``. A training run is tagged with the sha256 of the checkpoint it
produced, which is how the register stage finds it again. Runs themselves are
:mod:`pipeline.tracking.runs`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import yaml
from mlflow import MlflowClient

from pipeline.tracking.runs import CHECKPOINT_TAG, GIT_COMMIT_TAG, Tracking

__all__ = [
    "dataset_inputs",
    "dvc_experiment",
    "find_training_run",
    "lineage_tags",
    "tag_trained_checkpoint",
]


def _git_commit(project_root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=project_root,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an exported tree): the tag is left out, not faked
    return out.stdout.strip() or None


def _dvc_out_hashes(project_root: Path) -> dict[str, str]:
    """``{out path: md5}`` of every stage output recorded in ``dvc.lock`` (empty if none)."""
    lock = project_root / "dvc.lock"
    if not lock.exists():
        return {}
    data = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    hashes: dict[str, str] = {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            digest = out.get("md5") or out.get("etag") or out.get("checksum")
            if out.get("path") and digest:
                hashes[str(out["path"]).rstrip("/")] = str(digest)
    return hashes


def lineage_tags(
    project_root: Path,
    *,
    prepared_dir: str = "data/prepared",
    features_dir: str = "data/features",
) -> dict[str, str]:
    """Tags naming what a model was built from: git commit and the dvc.lock data hashes.

    Keys: ``mlflow.source.git.commit`` (MLflow's own), ``sat.prepared_md5``,
    ``sat.features_md5``; a key is absent when its source is (no git, no dvc.lock, stage not
    locked yet).
    """
    tags: dict[str, str] = {}
    commit = _git_commit(project_root)
    if commit:
        tags[GIT_COMMIT_TAG] = commit
    hashes = _dvc_out_hashes(project_root)
    for key, path in (("prepared", prepared_dir), ("features", features_dir)):
        digest = hashes.get(Path(path).as_posix().rstrip("/"))
        if digest:
            tags[f"sat.{key}_md5"] = digest
    return tags


def _dvc_source(path: str):
    """An MLflow dataset source naming a DVC-tracked path of this project (metadata only)."""
    from mlflow.data.dataset_source import DatasetSource

    class DvcDatasetSource(DatasetSource):
        def __init__(self, path: str) -> None:
            self.path = path

        @staticmethod
        def _get_source_type() -> str:
            return "dvc"

        def load(self, **kwargs):
            raise NotImplementedError(f"`dvc pull {self.path}` fetches it")

        @staticmethod
        def _can_resolve(raw_source) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source):
            return cls(str(raw_source))

        def to_dict(self) -> dict[str, str]:
            return {"path": self.path}

        @classmethod
        def from_dict(cls, source_dict):
            return cls(source_dict["path"])

    return DvcDatasetSource(path)


def dataset_inputs(
    project_root: Path, *, prepared_dir: str, features_dir: str, context: str = "training"
) -> list:
    """MLflow dataset inputs for the prepared data and the features, digest = DVC hash.

    Metadata only (nothing is read or uploaded): the source (type ``dvc``) is the
    project-relative path, and ``dvc pull`` fetches the content of that hash. Outputs not locked
    in ``dvc.lock`` are left out (nothing to name them by).
    """
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    hashes = _dvc_out_hashes(project_root)
    inputs = []
    for name, path in (("prepared", prepared_dir), ("features", features_dir)):
        key = Path(path).as_posix().rstrip("/")
        digest = hashes.get(key)
        if not digest:
            continue
        # mlflow declares `profile` abstract yet builds MetaDataset itself the same way
        dataset = MetaDataset(_dvc_source(key), name=name, digest=digest[:36])  # type: ignore[abstract]
        tags = [InputTag("mlflow.data.context", context), InputTag("dvc.md5", digest)]
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags))
    return inputs


def dvc_experiment(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the DVC experiment this process runs in (``dvc exp run``), else ``None``.

    ``dvc exp run`` gives every stage ``DVC_EXP_NAME`` and ``DVC_EXP_BASELINE_REV`` (see
    ``dvc/repo/experiments/queue/base.py``); ``dvc repro`` sets neither.
    """
    env = os.environ if environ is None else environ
    if not env.get("DVC_EXP_BASELINE_REV"):
        return None
    return env.get("DVC_EXP_NAME") or "unnamed"


def tag_trained_checkpoint(tracking: Tracking, run_id: str, model_dir: Path) -> str:
    """Tag the training run with the sha256 of the checkpoint it produced; return the hash.

    The register stage finds the training run of a model folder by this tag
    (:func:`find_training_run`), however the run was named.
    """
    from pipeline.tracking.registry import checkpoint_sha256

    sha = checkpoint_sha256(model_dir)
    tracking.call(lambda c: c.set_tag(run_id, CHECKPOINT_TAG, sha), f"tag run {run_id}")
    return sha


def find_training_run(tracking: Tracking, checkpoint_sha: str) -> str | None:
    """Id of the newest run tagged with ``checkpoint_sha`` (the run that trained it), if any."""
    query = f"tags.`{CHECKPOINT_TAG}` = '{checkpoint_sha}'"

    def find(client: MlflowClient) -> str | None:
        runs = client.search_runs(
            [tracking.experiment_id], query, max_results=1, order_by=["start_time DESC"]
        )
        return runs[0].info.run_id if runs else None

    return tracking.call(find, f"training run of checkpoint {checkpoint_sha[:12]}")
