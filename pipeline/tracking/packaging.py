"""Packaging a trained model for MLflow: log it as a pyfunc from code and register it.

The logged model carries the checkpoint files only, the ``sat_model`` library as code, the serving
model ``pipeline/tracking/pyfunc_model.py``, a signature and an input example, so it loads and
serves with nothing from this repository, and ``decode``: how the model was decoded when it was
scored, so it is served the same way. Versions are found again by the sha256 of their checkpoint
and their decoding (tags ``sat.checkpoint_sha256``, ``sat.decoding``): logging the same model twice
(a retry after the server was down) reuses the version instead of registering a duplicate; the same
checkpoint decoded another way is a new version. A model is logged into its training run when that
run is known (``run_id``), so the version's run is the training run: its curves, params, test
metrics and artifacts are one click away in MLflow's UI. Which version is champion is
:mod:`pipeline.tracking.registry`'s business.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from pipeline.tracking.registry import checkpoint_sha256, versions_of_checkpoint
from pipeline.tracking.runs import CHECKPOINT_TAG

__all__ = ["DECODING_TAG", "PYFUNC_FILE", "RegisteredVersion", "log_and_register"]

PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
DECODING_TAG = "sat.decoding"  # on a registered version: how its served model decodes (JSON)
_SAT_MODEL_DIR = Path(__file__).resolve().parents[2] / "sat_model"
# what the served model imports whatever its encoder, plus its encoder's own packages
# (sat_model.features.encoders.encoder_packages); exact versions of what is installed here (no
# network at log time, so nothing is inferred by importing the model in a fresh environment)
_REQUIREMENTS = (
    "torch",
    "torchvision",
    "pillow",
    "numpy",
    "pandas",
    "pyarrow",
    "pydantic",
    "pyyaml",  # sat_model.config reads params with both YAML libraries
    "ruamel.yaml",
    "mlflow",
)


@dataclass(frozen=True)
class RegisteredVersion:
    model_name: str
    version: str
    run_id: str | None
    checkpoint_sha256: str
    reused: bool  # True: this checkpoint was registered before; no new version was made


def _pip_requirements(checkpoint: Path) -> list[str]:
    """The served model's requirements: the common ones and those of the encoder recorded in
    ``checkpoint``'s ``config.json`` (a Lite2 model needs the Lite2 weights' package)."""
    from importlib.metadata import PackageNotFoundError, version

    from sat_model.features.encoders import encoder_packages
    from sat_model.features.spec import EncoderSpec
    from sat_model.model.checkpoint import CONFIG_FILE

    config = json.loads((checkpoint / CONFIG_FILE).read_text(encoding="utf-8"))
    encoder = encoder_packages(EncoderSpec.from_config(config, checkpoint).name)
    pins = []
    for name in dict.fromkeys((*_REQUIREMENTS, *encoder)):  # in order, once each
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    return pins


def _signature(beam_size: int) -> Any:
    """Inputs and params (MLflow enforces these); outputs as the rows are (documentation: MLflow
    checks no output), ``attention`` the object of :mod:`sat_model.caption_request`."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema

    attention = Object(
        [
            Property("words", Array("string")),
            Property("grid_h", "long"),
            Property("grid_w", "long"),
            Property("alphas", Array(Array("double"))),  # (len(words), grid_h * grid_w)
        ]
    )
    return ModelSignature(
        inputs=Schema([ColSpec("string", "image")]),
        outputs=Schema(
            [
                ColSpec("string", "caption"),
                ColSpec("string", "error", required=False),
                ColSpec("double", "drift", required=False),  # sat_model.features.drift
                ColSpec("boolean", "drifted", required=False),
                ColSpec(attention, "attention", required=False),
            ]
        ),
        params=ParamSchema(
            [
                ParamSpec("beam_size", "long", beam_size),
                ParamSpec("return_attention", "boolean", False),
            ]
        ),
    )


def _input_example() -> Any:
    """A small PNG as base64: the example travels with the model and needs no file."""
    import base64
    import io

    import pandas as pd
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 40)).save(buffer, format="PNG")
    return pd.DataFrame({"image": [base64.b64encode(buffer.getvalue()).decode()]})


def _serve_model_config(decoding: Mapping[str, Any]) -> dict[str, Any]:
    """The model config logged with the model: the ``serve`` defaults (limits) and ``decode``,
    the decoding the model was evaluated with, so the served model captions as it scored. MLflow
    lets a load override only keys logged here; ``sat serve`` replaces ``serve`` with the
    project's params and keeps ``decode``."""
    from pipeline.settings import ServeConfig

    return {"serve": ServeConfig().model_dump(mode="json"), "decode": dict(decoding)}


def _staged_checkpoint(model_dir: Path, tmp: Path) -> Path:
    """Only the checkpoint files go into the model (not curves, gallery or other outputs)."""
    import shutil

    from sat_model.model.checkpoint import model_files

    out = tmp / "checkpoint"
    out.mkdir()
    for name in model_files(model_dir):
        shutil.copy2(model_dir / name, out / name)
    return out


def _log_new_params(client: MlflowClient, run_id: str, params: Mapping[str, str]) -> None:
    """Params the run does not hold yet: a training run already holds its training params."""
    import mlflow

    held = client.get_run(run_id).data.params
    mlflow.log_params({k: v for k, v in params.items() if k not in held})


def _log_run_artifacts(run_artifacts: Sequence[tuple[str, str | Path]]) -> None:
    import mlflow

    for folder, local in run_artifacts:
        if Path(local).is_dir():
            mlflow.log_artifacts(str(local), artifact_path=folder)
        elif Path(local).is_file():
            mlflow.log_artifact(str(local), artifact_path=folder)


@contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for a block, then put back what was there.

    ``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI`` to the process
    environment; left behind, it would silently redirect every later ``connect()`` here.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous, previous_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]  # None unsets it
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env


def _log_model(checkpoint: Path, decoding: Mapping[str, Any], sha: str) -> str:
    """Log the checkpoint as a pyfunc from code into the active run; the logged model's URI."""
    import mlflow

    info = mlflow.pyfunc.log_model(
        name="model",
        python_model=str(PYFUNC_FILE),
        artifacts={"checkpoint": str(checkpoint)},
        code_paths=[str(_SAT_MODEL_DIR)],
        signature=_signature(int(decoding.get("beam_size", 3))),
        input_example=_input_example(),
        model_config=_serve_model_config(decoding),
        pip_requirements=_pip_requirements(checkpoint),
        metadata={CHECKPOINT_TAG: sha},  # what `sat serve` checks the files against
    )
    return str(info.model_uri)


def log_and_register(
    client: MlflowClient,
    *,
    model_dir: str | Path,
    model_name: str,
    experiment_id: str,
    metrics: Mapping[str, float],
    params: Mapping[str, str],
    tags: Mapping[str, str],
    run_artifacts: Sequence[tuple[str, str | Path]] = (),
    run_name: str | None = None,
    run_id: str | None = None,
    decoding: Mapping[str, Any] | None = None,
) -> RegisteredVersion:
    """Log ``model_dir`` as a pyfunc from code and register it, unless a version with the same
    checkpoint hash exists (then that version is returned, ``reused=True``).

    The model, ``metrics``, ``params`` and ``tags`` go into run ``run_id`` (the training run)
    when given, else into a new run called ``run_name``. ``run_artifacts`` pairs artifact folders
    with local files or directories (captions, curves, the attention gallery); missing ones are
    left out. ``decoding`` (``beam_size``, ``max_length``, ``length_penalty``, ``mode``: the
    :class:`sat_model.captioner.Captioner` options) is how the served model decodes; the
    Captioner's defaults where absent. A version is one checkpoint decoded one way: the same
    checkpoint with another decoding is a new version, logged into a run of its own. ``client``
    names the tracking store: the fluent API is pointed at the same URI.
    """
    import tempfile

    import mlflow

    model_dir = Path(model_dir)
    sha = checkpoint_sha256(model_dir)
    decoding = dict(decoding or {})
    decoding_tag = json.dumps(decoding, sort_keys=True)
    versions = versions_of_checkpoint(client, model_name, sha)
    existing = next((v for v in versions if v.tags.get(DECODING_TAG) == decoding_tag), None)
    if existing is not None:
        return RegisteredVersion(model_name, str(existing.version), existing.run_id, sha, True)
    if run_id is not None and versions:
        # the checkpoint is registered already, decoded another way: the training run's metrics
        # are that version's scores, so this one's go into a run of its own
        run_id = None
    version_tags = {**tags, CHECKPOINT_TAG: sha, DECODING_TAG: decoding_tag}
    with (
        _fluent_tracking_uri(client.tracking_uri),
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(
            run_id=run_id,
            experiment_id=None if run_id else experiment_id,
            run_name=None if run_id else run_name,
            tags=dict(version_tags),
        ) as run,
    ):
        _log_new_params(client, run.info.run_id, params)
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        _log_run_artifacts(run_artifacts)
        model_uri = _log_model(_staged_checkpoint(model_dir, Path(tmp)), decoding, sha)
        version = mlflow.register_model(model_uri, model_name, tags=version_tags)
    return RegisteredVersion(model_name, str(version.version), run.info.run_id, sha, False)
