"""A registered model, loaded to serve with the installed code and checked against its record.

The model's files are downloaded (a ``models:/`` or ``runs:/`` URI) or read (an MLflow model
folder); of them only the checkpoint (weights, config and vocabulary: data that never runs code)
and the decoding recorded with the model are used. The code logged beside the checkpoint is
never imported: whoever can write to the registry can change weights, not what runs. Before
anything loads, the checkpoint's sha256 must equal the one recorded when it was registered (the
version's tag ``sat.checkpoint_sha256``; for a folder or a run, the MLmodel metadata), so a
checkpoint changed in the artifact store is refused with one line.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.tracking.model_uri import is_model_uri
from pipeline.tracking.registry import checkpoint_sha256
from pipeline.tracking.runs import CHECKPOINT_TAG, redact
from sat_model.caption_request import CaptionService
from sat_model.config import ServeConfig

__all__ = ["ServeError", "ServedModel", "load_served_model"]


class ServeError(RuntimeError):
    """A model that cannot be served: one line for the user, before any server starts."""


@dataclass(frozen=True)
class ServedModel:
    service: CaptionService
    uri: str
    version: str | None  # the registry's version number, for a models:/ URI
    checkpoint_sha256: str
    decode: dict[str, Any]

    def describe(self) -> dict[str, Any]:
        """What ``GET /version`` answers."""
        return {
            "model": self.uri,
            "version": self.version,
            "checkpoint_sha256": self.checkpoint_sha256,
            "decode": self.decode,
        }


def load_served_model(model_uri: str, tracking_uri: str, serve: ServeConfig) -> ServedModel:
    """Fetch ``model_uri``, check its checkpoint and load it; :class:`ServeError` if unusable.
    Downloaded files are removed once the model is in memory."""
    from sat_model.features.encoders import EncoderError
    from sat_model.model.checkpoint import CheckpointError

    with tempfile.TemporaryDirectory(prefix="sat-serve-") as tmp:
        model_dir, version, recorded = _fetch(model_uri, tracking_uri, Path(tmp))
        mlmodel = _mlmodel(model_dir, model_uri)
        pyfunc = mlmodel.get("flavors", {}).get("python_function", {})
        checkpoint = _checkpoint_dir(model_dir, pyfunc, model_uri)
        recorded = recorded or mlmodel.get("metadata", {}).get(CHECKPOINT_TAG)
        if not recorded:
            raise ServeError(f"{model_uri} has no recorded checkpoint sha256; register it again")
        try:
            found = checkpoint_sha256(checkpoint)
        except FileNotFoundError as e:
            raise ServeError(f"{model_uri}: {e}") from None
        if found != recorded:
            raise ServeError(
                f"refusing {model_uri}: its checkpoint's sha256 {found[:12]} is not the "
                f"{recorded[:12]} recorded when it was registered"
            )
        decode = dict((pyfunc.get("config") or {}).get("decode") or {})
        try:
            service = CaptionService.from_dir(checkpoint, serve, decode)
        except (CheckpointError, EncoderError, ValueError, TypeError) as e:
            raise ServeError(f"cannot load {model_uri}: {str(e).splitlines()[0][:300]}") from None
    return ServedModel(service, model_uri, version, found, decode)


def _fetch(model_uri: str, tracking_uri: str, dst: Path) -> tuple[Path, str | None, str | None]:
    """The model's local folder, its registry version and the sha256 the registry recorded."""
    if not is_model_uri(model_uri):
        local = Path(model_uri).expanduser()
        if not (local / "MLmodel").is_file():
            raise ServeError(f"{model_uri} is not an MLflow model folder (no MLmodel file)")
        return local.resolve(), None, None
    import mlflow
    from mlflow.exceptions import MlflowException

    if tracking_uri.startswith("sqlite:///") and model_uri.startswith(("models:/", "runs:/")):
        store = Path(tracking_uri.removeprefix("sqlite:///"))  # four slashes: absolute
        if not store.is_file():  # MLflow would create an empty store and then not find it
            raise ServeError(f"cannot load {model_uri}: there is no MLflow store at {store}")
    try:
        version, recorded, location = _registered(model_uri, tracking_uri)
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=location, dst_path=str(dst), tracking_uri=tracking_uri
        )
    except (MlflowException, OSError) as e:
        first = str(getattr(e, "message", e)).strip().splitlines()[0][:300]
        raise ServeError(
            f"cannot load {model_uri} from {redact(tracking_uri)}: {redact(first)}"
        ) from None
    return Path(path), version, recorded


def _registered(model_uri: str, tracking_uri: str) -> tuple[str | None, str | None, str]:
    """For ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: the version, its recorded
    checkpoint sha256 and where its files are; other URIs are downloaded as they are."""
    if not model_uri.startswith("models:/"):
        return None, None, model_uri
    from mlflow import MlflowClient
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = get_model_name_and_version(client, model_uri.rstrip("/"))
    if len(found) == 1:  # models:/<logged model id>, not a registry name
        return None, None, model_uri
    name, number = found
    version = client.get_model_version(name, number)
    return (
        str(number),
        version.tags.get(CHECKPOINT_TAG),
        client.get_model_version_download_uri(name, number),
    )


def _checkpoint_dir(model_dir: Path, pyfunc: dict[str, Any], model_uri: str) -> Path:
    """The folder of the pyfunc's ``checkpoint`` artifact, inside the model folder."""
    path = ((pyfunc.get("artifacts") or {}).get("checkpoint") or {}).get("path")
    found = (model_dir / str(path)).resolve() if path else None
    if found is None or not found.is_relative_to(model_dir.resolve()) or not found.is_dir():
        raise ServeError(f"{model_uri} holds no checkpoint artifact")
    return found


def _mlmodel(model_dir: Path, model_uri: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load((model_dir / "MLmodel").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ServeError(f"{model_uri}: unreadable MLmodel file ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise ServeError(f"{model_uri}: the MLmodel file is not a mapping")
    return doc
