"""A registered model, loaded to serve with the installed code and checked against its record.

The model's files are downloaded (a ``models:/`` or ``runs:/`` URI) or read (an MLflow model
folder) and checked against the sha256 recorded when it was registered, as every command that
loads a registered model does (:func:`pipeline.tracking.model_uri.fetch_model`); of them only
the checkpoint (weights, config and vocabulary: data that never runs code) and the decoding
recorded with the model are used. The code logged beside the checkpoint is never imported:
whoever can write to the registry can change weights, not what runs.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.settings import ServeConfig
from pipeline.tracking.model_uri import FetchedModel, ModelCheckError, fetch_model, is_model_uri
from pipeline.tracking.store import redact

if TYPE_CHECKING:
    from sat_model.caption_request import CaptionService

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
            # a folder by its name only: a client learns no path of the server
            "model": self.uri if is_model_uri(self.uri) else Path(self.uri).name,
            "version": self.version,
            "checkpoint_sha256": self.checkpoint_sha256,
            "decode": self.decode,
        }


def load_served_model(model_uri: str, tracking_uri: str, serve: ServeConfig) -> ServedModel:
    """Fetch ``model_uri``, check its checkpoint and load it; :class:`ServeError` if unusable.
    Downloaded files are removed once the model is in memory."""
    with tempfile.TemporaryDirectory(prefix="sat-serve-") as tmp:
        fetched = _fetch(model_uri, tracking_uri, Path(tmp))
        # PyTorch once the model is there: a missing one is told without it
        from sat_model.caption_request import CaptionService
        from sat_model.features.encoders import EncoderError
        from sat_model.model.checkpoint import CheckpointError

        assert fetched.sha256 is not None  # an MLflow model, checked against its record
        decode = dict(fetched.pyfunc_config.get("decode") or {})
        try:
            service = CaptionService.from_dir(fetched.checkpoint, serve, decode)
        except (CheckpointError, EncoderError, ValueError, TypeError) as e:
            raise ServeError(f"cannot load {model_uri}: {str(e).splitlines()[0][:300]}") from None
    return ServedModel(service, model_uri, fetched.version, fetched.sha256, decode)


def _fetch(model_uri: str, tracking_uri: str, dst: Path) -> FetchedModel:
    """The model fetched and checked (:func:`~pipeline.tracking.model_uri.fetch_model`): an
    MLflow model only, never a bare checkpoint folder, which has no record to check."""
    if not is_model_uri(model_uri) and not (Path(model_uri).expanduser() / "MLmodel").is_file():
        raise ServeError(f"{model_uri} is not an MLflow model folder (no MLmodel file)")
    try:
        return fetch_model(model_uri, dst, tracking_uri)
    except ModelCheckError as e:  # an absent local store among them: told without MLflow
        raise ServeError(str(e)) from None
    except Exception as e:
        from mlflow.exceptions import MlflowException

        if not isinstance(e, MlflowException | OSError):
            raise
        first = str(getattr(e, "message", e)).strip().splitlines()[0][:300]
        raise ServeError(
            f"cannot load {model_uri} from {redact(tracking_uri)}: {redact(first)}"
        ) from None
