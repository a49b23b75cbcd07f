"""Where a model to evaluate, caption or serve comes from, checked against its record.

A checkpoint folder (``models/soft``) is used as it is. An MLflow model (a ``models:/`` or
``runs:/`` URI, or a folder holding an ``MLmodel`` file) is downloaded, and its checkpoint (the
pyfunc model's ``checkpoint`` artifact) must have the sha256 recorded when it was registered
(the version's tag ``sat.checkpoint_sha256``; for a run or a folder, the MLmodel metadata).
Every command that loads a registered model passes here (``sat caption`` and its Ray engine,
``sat evaluate`` and the evaluate stage, ``sat serve`` and the replicas of ``--engine ray``),
so a checkpoint changed in the artifact store is refused with one line wherever it would load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FetchedModel", "ModelCheckError", "fetch_model", "is_model_uri", "resolve_model_dir"]


class ModelCheckError(ValueError):
    """A model that is not what was registered, or not a model at all: one line for the user."""


@dataclass(frozen=True)
class FetchedModel:
    checkpoint: Path  # the checkpoint folder: state dict, model config, vocabulary
    version: str | None  # the registry's version, for models:/NAME@ALIAS or models:/NAME/N
    sha256: str | None  # the checked sha256; None for a checkpoint folder, which has no record
    pyfunc_config: dict[str, Any]  # the model_config logged with the pyfunc (its decoding)


def is_model_uri(model: str) -> bool:
    """Whether ``model`` names an MLflow model (``models:/``, ``runs:/``, ``s3://`` ...)."""
    return "://" in model or model.startswith(("models:/", "runs:/"))


def resolve_model_dir(model: str, workdir: Path, tracking_uri: str | None = None) -> Path:
    """The checkpoint folder of ``model``, fetched into ``workdir`` and checked
    (:func:`fetch_model`)."""
    return fetch_model(model, workdir, tracking_uri).checkpoint


def fetch_model(model: str, workdir: Path, tracking_uri: str | None = None) -> FetchedModel:
    """A checkpoint folder as is; an MLflow model folder read, an MLflow URI downloaded into
    ``workdir``, and its checkpoint checked against the recorded sha256
    (:class:`ModelCheckError` otherwise; MLflow's own errors go up as they are)."""
    if not is_model_uri(model):
        local = Path(model).expanduser()
        if not (local / "MLmodel").is_file():
            return FetchedModel(local, None, None, {})
        return _checked(model, local.resolve(), None, None)
    if tracking_uri and tracking_uri.startswith("sqlite:///"):
        store = Path(tracking_uri.removeprefix("sqlite:///"))  # four slashes: absolute
        if model.startswith(("models:/", "runs:/")) and not store.is_file():
            # MLflow would create an empty store and then not find the model in it
            raise ModelCheckError(f"cannot load {model}: there is no MLflow store at {store}")
    import mlflow

    version, recorded, location = _registered(model, tracking_uri)
    downloaded = mlflow.artifacts.download_artifacts(
        artifact_uri=location, dst_path=str(workdir), tracking_uri=tracking_uri
    )
    return _checked(model, Path(downloaded), version, recorded)


def _registered(model: str, tracking_uri: str | None) -> tuple[str | None, str | None, str]:
    """For ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: the version, its recorded sha256
    and where its files are, looked up in the registry at ``tracking_uri`` (MLflow's own
    download would ask the process-wide registry, so a store named only in params would never
    be asked); other URIs are downloaded as they are."""
    if not model.startswith("models:/") or not tracking_uri:
        return None, None, model
    from mlflow import MlflowClient
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    from pipeline.tracking.runs import CHECKPOINT_TAG

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = get_model_name_and_version(client, model.rstrip("/"))
    if len(found) == 1:  # models:/<logged model id>, not a registry name
        return None, None, model
    name, number = found
    version = client.get_model_version(name, number)
    location = client.get_model_version_download_uri(name, number)
    return str(number), version.tags.get(CHECKPOINT_TAG), location


def _checked(
    model: str, model_dir: Path, version: str | None, recorded: str | None
) -> FetchedModel:
    """The MLflow model in ``model_dir`` once its checkpoint matches its record."""
    from pipeline.tracking.registry import checkpoint_sha256
    from pipeline.tracking.runs import CHECKPOINT_TAG

    mlmodel = _mlmodel(model_dir, model)
    pyfunc = mlmodel.get("flavors", {}).get("python_function", {})
    checkpoint = _checkpoint_dir(model_dir, pyfunc, model)
    recorded = recorded or (mlmodel.get("metadata") or {}).get(CHECKPOINT_TAG)
    if not recorded:
        raise ModelCheckError(f"{model} has no recorded checkpoint sha256; register it again")
    try:
        found = checkpoint_sha256(checkpoint)
    except FileNotFoundError as e:
        raise ModelCheckError(f"{model}: {e}") from None
    if found != recorded:
        raise ModelCheckError(
            f"refusing {model}: its checkpoint's sha256 {found[:12]} is not the "
            f"{str(recorded)[:12]} recorded when it was registered"
        )
    return FetchedModel(checkpoint, version, found, dict(pyfunc.get("config") or {}))


def _checkpoint_dir(model_dir: Path, pyfunc: dict[str, Any], model: str) -> Path:
    """The folder of the pyfunc's ``checkpoint`` artifact, inside the model folder."""
    from pipeline.tracking.pyfunc_model import CHECKPOINT_ARTIFACT

    path = ((pyfunc.get("artifacts") or {}).get(CHECKPOINT_ARTIFACT) or {}).get("path")
    found = (model_dir / str(path)).resolve() if path else None
    if found is None or not found.is_relative_to(model_dir.resolve()) or not found.is_dir():
        raise ModelCheckError(f"{model} holds no checkpoint artifact")
    return found


def _mlmodel(model_dir: Path, model: str) -> dict[str, Any]:
    import yaml

    try:
        doc = yaml.safe_load((model_dir / "MLmodel").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ModelCheckError(f"{model}: unreadable MLmodel file ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise ModelCheckError(f"{model}: the MLmodel file is not a mapping")
    return doc
