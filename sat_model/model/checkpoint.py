"""The model folder (``models/<attention>/``) and its self-describing checkpoint. Every file name
is spelled here::

    model.safetensors   the weights to use (the moving average when training kept one)
    config.json         what rebuilds the model: model, encoder, train and data sections
    vocab.json          the vocabulary
    best_state.pt       the rest of that epoch's training state: for resuming only
    train_metrics.json, curves.csv, last_state.pt    training's (:mod:`sat_model.train.run`)

A model for use (captioning, evaluation, serving) is read from ``model.safetensors`` and the two
JSON files alone: no pickle. ``model.safetensors`` is the ecosystem's format for weights that never
run code: ``safetensors.torch.load_file`` reads it and ``ShowAttendTell(ModelConfig(**config
["model"])).load_state_dict`` takes it. Its metadata holds ``format_version``, copies of
``config.json`` and the vocabulary (the file alone rebuilds the model) and ``weights_sha256``
(:func:`weights_sha256`): safetensors has no checksum, and a flipped byte would load as another
weight.

``best_state.pt`` holds what only resuming needs, in a form safetensors cannot (nested optimiser
dicts): ``train_state`` (the weights the optimiser was updating, when the saved ones are their
average), ``criterion_state`` (hard attention's REINFORCE baseline, a training quantity that
decoding never reads), ``optimizer_state``, ``scheduler_state``, ``epoch``, ``best_score``,
``best_epoch`` and the ``weights_sha256`` of the weights it goes with. It is a ``torch.save`` of
plain containers and tensors, read with ``torch.load(weights_only=True)`` after its zip CRCs are
checked (torch does not check them): a file that carries pickled code is refused, never run.

Every file is written atomically, ``model.safetensors`` last: it is the commit point, and a folder
whose other files disagree with it (a crash between writes, files copied from elsewhere) is
refused. Format 1 kept weights and training state in one ``model.pt`` (a ``torch.save`` with
``config`` and ``itos`` inside); such folders still load, for use and to resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn

from sat_model.atomic import write_bytes_atomic, write_text_atomic
from sat_model.data.vocab import Vocab, VocabError, load_vocab, save_vocab
from sat_model.model.checkpoint_checks import (
    NONE,
    CheckpointError,
    check_archive,
    check_shapes,
    check_tensors,
    check_types,
    check_version,
    load_pt,
    model_config,
)
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.kernels import build_backend

__all__ = [
    "BEST_STATE_FILE",
    "CONFIG_FILE",
    "CURVES_FILE",
    "FORMAT_VERSION",
    "LAST_STATE_FILE",
    "LEGACY_MODEL_FILE",
    "MODEL_FILE",
    "TRAIN_METRICS_FILE",
    "VOCAB_FILE",
    "Checkpoint",
    "CheckpointError",
    "TrainingState",
    "check_archive",
    "is_checkpoint_dir",
    "load_checkpoint",
    "load_model",
    "model_files",
    "model_from_checkpoint",
    "recorded_data_source",
    "save_checkpoint",
    "state_of",
    "weights_sha256",
]

FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1  # model.pt alone
MODEL_FILE, CONFIG_FILE, VOCAB_FILE = "model.safetensors", "config.json", "vocab.json"
BEST_STATE_FILE = "best_state.pt"  # what resuming from model.safetensors needs beyond weights
LEGACY_MODEL_FILE = "model.pt"  # format 1: weights and training state in one torch.save
TRAIN_METRICS_FILE, CURVES_FILE = "train_metrics.json", "curves.csv"  # training summary, curves
LAST_STATE_FILE = "last_state.pt"  # the last epoch's training state, to resume from
# what a training state holds (extra keys are allowed: later formats add sections)
_TRAINING_TYPES: dict[str, tuple[type, ...]] = {
    "criterion_state": (dict,),
    "optimizer_state": (dict, NONE),
    "scheduler_state": (dict, NONE),
    "epoch": (int,),
    "best_score": (float, int, NONE),
    "best_epoch": (int, NONE),
}
# format 1's model.pt: the training state beside the weights, config and vocabulary
_LEGACY_TYPES = {"model_state": (dict,), **_TRAINING_TYPES, "config": (dict,), "itos": (list,)}
_METADATA_KEYS = ("format_version", "config", "itos", "weights_sha256")


@dataclass(frozen=True)
class TrainingState:
    """What resuming from a checkpoint needs beyond its weights (``best_state.pt``)."""

    criterion_state: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    optimizer_state: Mapping[str, Any] | None = None
    scheduler_state: Mapping[str, Any] | None = None
    epoch: int = 0  # epochs completed when saved
    best_score: float | None = None  # best validation score so far (train.monitor's)
    best_epoch: int | None = None
    # the optimiser's weights when model_state is their moving average; else None
    train_state: Mapping[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder, loaded and cross-checked: the model and what describes it."""

    model_config: ModelConfig
    vocab: Vocab
    model_state: dict[str, torch.Tensor]
    config: dict[str, Any]  # the whole config.json: model, encoder, train, ...
    format_version: int = FORMAT_VERSION
    training: TrainingState | None = None  # read only when asked (load_checkpoint(training=True))


def recorded_data_source(config: Mapping[str, Any]) -> str | None:
    """The data source (``data.source``: ``synthetic``, ``flickr8k``, ...) that a checkpoint's
    config says the model was trained on; None for a checkpoint that predates the record."""
    data = config.get("data")
    source = data.get("source") if isinstance(data, Mapping) else None
    return source if isinstance(source, str) else None


def save_checkpoint(
    directory: str | Path,
    *,
    model_config: ModelConfig,
    vocab: Vocab,
    model_state: Mapping[str, torch.Tensor],
    training: TrainingState = TrainingState(),
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``best_state.pt`` (``training``), ``config.json``, ``vocab.json`` and
    ``model.safetensors`` under ``directory`` (in that order); return it.

    ``extra_config`` adds JSON-able sections to ``config.json`` beside ``model`` (the encoder
    description from the feature store, the train params).
    """
    if model_config.vocab_size != len(vocab):
        raise CheckpointError(
            f"model vocab_size {model_config.vocab_size} != vocabulary size {len(vocab)}"
        )
    directory = Path(directory)
    config = {"format_version": FORMAT_VERSION, "model": dataclasses.asdict(model_config)}
    config.update(dict(extra_config or {}))
    weights = {k: v.detach().cpu().contiguous() for k, v in model_state.items()}
    digest = weights_sha256(weights)
    s = training
    payload = {
        "format_version": FORMAT_VERSION,
        "weights_sha256": digest,  # which weights this state goes with
        "train_state": _cpu(s.train_state) if s.train_state is not None else None,
        "criterion_state": _cpu(s.criterion_state),
        "optimizer_state": _cpu(s.optimizer_state) if s.optimizer_state is not None else None,
        "scheduler_state": dict(s.scheduler_state) if s.scheduler_state is not None else None,
        "epoch": int(s.epoch),
        "best_score": None if s.best_score is None else float(s.best_score),
        "best_epoch": None if s.best_epoch is None else int(s.best_epoch),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(config),
        "itos": json.dumps(list(vocab.itos)),
        "weights_sha256": digest,
    }
    write_bytes_atomic(directory / BEST_STATE_FILE, buffer.getvalue())
    write_text_atomic(directory / CONFIG_FILE, json.dumps(config, indent=1) + "\n")
    save_vocab(vocab, directory / VOCAB_FILE)
    write_bytes_atomic(directory / MODEL_FILE, safetensors_bytes(weights, metadata))  # commit
    (directory / LEGACY_MODEL_FILE).unlink(missing_ok=True)  # a resumed format-1 folder's old
    return directory


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: what
    ``model.safetensors`` records of its weights (safetensors itself checks no sum)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_checkpoint(
    directory: str | Path,
    vocab: Vocab | None = None,
    map_location: str = "cpu",
    *,
    training: bool = False,
) -> Checkpoint:
    """Read and cross-check a checkpoint folder; :class:`CheckpointError` says what is wrong.

    ``vocab``, when given, must be the checkpoint's vocabulary (e.g. the prepared data's).
    ``training`` also reads what resuming needs (``Checkpoint.training``); without it only
    ``model.safetensors`` and the JSON files are read.
    """
    directory = Path(directory)
    path = directory / MODEL_FILE
    if not path.is_file() and (directory / LEGACY_MODEL_FILE).is_file():
        return _load_legacy(directory, vocab, map_location, training)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with safe_open(path, framework="pt", device=map_location) as f:
            metadata = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (no __iter__)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    config, itos, digest = _read_metadata(metadata, path)
    if weights_sha256(state) != digest:
        raise CheckpointError(f"{path} is corrupted: its tensors differ from their sha256")
    model_config, file_vocab = _cross_check(directory, path, config, itos, state, vocab)
    saved = _load_best_state(directory, digest, model_config, map_location) if training else None
    return Checkpoint(model_config, file_vocab, state, config, FORMAT_VERSION, training=saved)


def _load_best_state(
    directory: Path, digest: str, config: ModelConfig, map_location: str
) -> TrainingState:
    """``best_state.pt``, which must name the digest of the weights beside it."""
    path = directory / BEST_STATE_FILE
    payload = load_pt(path, map_location, "training state")
    check_version(payload.get("format_version"), FORMAT_VERSION, path)
    if payload.get("weights_sha256") != digest:
        raise CheckpointError(
            f"{path} belongs to other weights than {MODEL_FILE} (a crash between writes, or "
            f"files from elsewhere)"
        )
    return _training_state(payload, path, config)


def _load_legacy(
    directory: Path, vocab: Vocab | None, map_location: str, training: bool
) -> Checkpoint:
    """A format-1 folder: weights, training state, config and vocabulary in one ``model.pt``."""
    path = directory / LEGACY_MODEL_FILE
    payload = load_pt(path, map_location, "checkpoint")
    if "model_state" not in payload:
        raise CheckpointError(f"{path} is not a sat checkpoint (no model_state)")
    check_version(payload.get("format_version"), LEGACY_FORMAT_VERSION, path)
    check_types(payload, path, _LEGACY_TYPES)
    state = payload["model_state"]
    model_config, file_vocab = _cross_check(
        directory, path, payload["config"], payload["itos"], state, vocab
    )
    saved = _training_state(payload, path, model_config) if training else None
    config = payload["config"]
    return Checkpoint(
        model_config, file_vocab, state, config, LEGACY_FORMAT_VERSION, training=saved
    )


def _read_metadata(
    metadata: Mapping[str, str], path: Path
) -> tuple[dict[str, Any], list[str], str]:
    """``config``, ``itos`` and ``weights_sha256`` from ``model.safetensors``' metadata."""
    missing = [key for key in _METADATA_KEYS if key not in metadata]
    if missing:
        raise CheckpointError(f"{path} is not a sat checkpoint: no {missing[0]!r} in its metadata")
    check_version(metadata["format_version"], FORMAT_VERSION, path)
    try:
        sections = {key: json.loads(metadata[key]) for key in ("config", "itos")}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: its metadata is not JSON: {e}") from None
    check_types(sections, path, {"config": (dict,), "itos": (list,)})
    return sections["config"], sections["itos"], metadata["weights_sha256"]


def _cross_check(
    directory: Path,
    path: Path,
    config: dict[str, Any],
    itos: list[str],
    state: Mapping[str, torch.Tensor],
    vocab: Vocab | None,
) -> tuple[ModelConfig, Vocab]:
    """The model config, checked against the weights' shapes, and the vocabulary, checked
    against ``vocab.json``, ``vocab`` and the config; ``config.json`` must equal ``config``."""
    checked = model_config(config.get("model"), directory)
    check_shapes(checked, state, path, "model_state")
    file_vocab = _check_vocab(directory, path.name, itos, checked, vocab)
    _check_config_json(directory, path.name, config)
    return checked, file_vocab


def _training_state(payload: dict[str, Any], path: Path, config: ModelConfig) -> TrainingState:
    """The checked :class:`TrainingState` of a ``best_state.pt`` or format-1 ``model.pt``."""
    check_types(payload, path, _TRAINING_TYPES)
    train_state = payload.get("train_state")
    if train_state is not None:
        check_tensors(train_state, path, "train_state")
        check_shapes(config, train_state, path, "train_state")
    return TrainingState(
        criterion_state=payload["criterion_state"],
        optimizer_state=payload["optimizer_state"],
        scheduler_state=payload["scheduler_state"],
        epoch=payload["epoch"],
        best_score=payload["best_score"],
        best_epoch=payload["best_epoch"],
        train_state=train_state,  # absent in checkpoints written before it
    )


def load_model(
    directory: str | Path, device: str | torch.device = "cpu", backend: str = "native"
) -> tuple[ShowAttendTell, Vocab, ModelConfig]:
    """Rebuild the model from the folder alone, in eval mode, on ``device``."""
    return model_from_checkpoint(load_checkpoint(directory), device, directory, backend)


def model_from_checkpoint(
    ckpt: Checkpoint,
    device: str | torch.device = "cpu",
    source: str | Path = "checkpoint",
    backend: str = "native",
) -> tuple[ShowAttendTell, Vocab, ModelConfig]:
    """The model of a loaded checkpoint, in eval mode, on ``device`` (``source`` names it),
    computed by ``backend`` (``model.backend``)."""
    model = ShowAttendTell(ckpt.model_config, backend=build_backend(backend))
    try:
        model.load_state_dict(ckpt.model_state)
    except RuntimeError as e:  # missing/unexpected keys or shape mismatches
        raise CheckpointError(f"{source}: weights do not fit the saved model config: {e}") from e
    return model.to(device).eval(), ckpt.vocab, ckpt.model_config


def _cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    # checkpoints must load on a machine without the GPU they were trained on
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, Mapping):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(move(v) for v in value)
        return value

    moved: dict[str, Any] = move(state)
    return moved


def _check_vocab(
    directory: Path, weights: str, itos: list[str], config: ModelConfig, given: Vocab | None
) -> Vocab:
    try:
        on_disk = load_vocab(directory / VOCAB_FILE)
    except VocabError as e:
        raise CheckpointError(f"{directory}: {e}") from e
    if list(on_disk.itos) != list(itos):
        raise CheckpointError(
            f"{directory / VOCAB_FILE} ({len(on_disk)} words) is not the vocabulary "
            f"{weights} was trained with ({len(itos)} words)"
        )
    if config.vocab_size != len(itos):
        raise CheckpointError(
            f"{directory}: model vocab_size {config.vocab_size} != vocabulary size {len(itos)}"
        )
    if given is not None and list(given.itos) != list(itos):
        raise CheckpointError(
            f"{directory} was trained with another vocabulary: {len(itos)} words in the "
            f"checkpoint, {len(given)} in the one given"
            + ("" if len(given) != len(itos) else " (same size, different words)")
        )
    return on_disk


def _check_config_json(directory: Path, weights: str, config: dict[str, Any]) -> None:
    try:
        on_disk = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {directory / CONFIG_FILE}: {e}") from e
    if on_disk != config:
        raise CheckpointError(f"{directory / CONFIG_FILE} does not match {weights}")


def is_checkpoint_dir(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint sat wrote: ``model.safetensors`` (or format 1's
    ``model.pt``) beside a ``config.json`` with sat's keys (the test for "ours" before a model
    folder is replaced)."""
    directory = Path(directory)
    if not (directory / model_files(directory)[0]).is_file():
        return False
    try:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "format_version" in config and "model" in config


def model_files(directory: str | Path) -> tuple[str, str, str]:
    """The files of ``directory`` that a model for use is loaded from (what a packaged model
    carries and its hash covers): the weights, ``config.json`` and ``vocab.json``. The weights
    are ``model.safetensors``, or ``model.pt`` in a format-1 folder."""
    directory = Path(directory)
    legacy = (directory / LEGACY_MODEL_FILE).is_file() and not (directory / MODEL_FILE).is_file()
    return (LEGACY_MODEL_FILE if legacy else MODEL_FILE, CONFIG_FILE, VOCAB_FILE)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``module.state_dict()`` (kept as the best model while training)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
