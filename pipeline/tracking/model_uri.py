"""Where a model to evaluate, caption or serve comes from: a folder, or an MLflow model URI.

``sat evaluate``, the ``evaluate`` stage and ``sat caption`` accept either; a URI is downloaded
and its checkpoint folder (the ``checkpoint`` artifact of the pyfunc model) handed back.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_model_uri", "resolve_model_dir"]


def is_model_uri(model: str) -> bool:
    """Whether ``model`` names an MLflow model (``models:/``, ``runs:/``, ``s3://`` ...)."""
    return "://" in model or model.startswith(("models:/", "runs:/"))


def resolve_model_dir(model: str, workdir: Path, tracking_uri: str | None = None) -> Path:
    """A local model folder as is; an MLflow URI (``models:/``, ``runs:/``) downloaded into
    ``workdir`` and its checkpoint artifact returned."""
    if not is_model_uri(model):
        return Path(model)
    import mlflow

    from pipeline.tracking.pyfunc_model import CHECKPOINT_ARTIFACT
    from sat_model.model.checkpoint import CONFIG_FILE, MODEL_FILE, is_checkpoint_dir

    if model.startswith("models:/") and tracking_uri:
        model = _registry_location(model, tracking_uri)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=model, dst_path=str(workdir), tracking_uri=tracking_uri
    )
    found = sorted(p.parent for p in Path(local).rglob(CONFIG_FILE) if is_checkpoint_dir(p.parent))
    checkpoints = [p for p in found if p.name == CHECKPOINT_ARTIFACT] or found
    if not checkpoints:
        raise FileNotFoundError(f"{model} holds no checkpoint ({MODEL_FILE})")
    return checkpoints[0]


def _registry_location(model: str, tracking_uri: str) -> str:
    """Where the registered model version ``models:/NAME@ALIAS[/path]`` (or ``NAME/VERSION``)
    stores its files, looked up in the registry at ``tracking_uri``.

    MLflow's own download looks the name up in the process-wide registry URI whatever
    ``tracking_uri`` it is given, so a store named only in params would never be asked.
    """
    from mlflow import MlflowClient
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    base, path = ModelsArtifactRepository.split_models_uri(model)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = get_model_name_and_version(client, base)
    if len(found) == 1:  # models:/<logged model id>, not a registry name
        return model
    location = client.get_model_version_download_uri(*found).rstrip("/")
    return f"{location}/{path}" if path else location
