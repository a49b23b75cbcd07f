"""The model folder (``models/<attention>/``) and its self-describing checkpoint: ``model.pt`` +
``config.json`` + ``vocab.json``, beside training's ``train_metrics.json``, ``curves.csv`` and
``last_state.pt`` (written by :mod:`sat_model.train.run`). Every file name is spelled here.

``model.pt`` is a ``torch.save`` of plain containers and tensors only: ``format_version``,
``model_state`` (the weights to use: the moving average when training kept one),
``train_state`` (the weights the optimiser was updating, to resume from; absent or None when
they are ``model_state``), ``criterion_state`` (the hard-attention baseline buffer lives there),
``optimizer_state``, ``scheduler_state``, ``epoch``, ``best_score``, ``best_epoch``, ``config``
(the JSON-able dict of ``config.json``) and ``itos`` (the vocabulary). It is always read with
``torch.load(weights_only=True)``, so a file that carries pickled code (a whole ``nn.Module``,
a custom class) is refused, never run. ``config.json`` and ``vocab.json`` are readable copies for
people and other tools; they must agree with ``model.pt``.

Every file is written atomically, ``model.pt`` last: it is the commit point, and a folder whose
JSON files disagree with it (a crash between writes, files copied from elsewhere) is refused.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sat_model.atomic import write_bytes_atomic, write_text_atomic
from sat_model.data.vocab import Vocab, VocabError, load_vocab, save_vocab
from sat_model.model.decoder import ModelConfig, ShowAttendTell

__all__ = [
    "CONFIG_FILE",
    "CURVES_FILE",
    "FORMAT_VERSION",
    "LAST_STATE_FILE",
    "MODEL_FILE",
    "TRAIN_METRICS_FILE",
    "VOCAB_FILE",
    "Checkpoint",
    "CheckpointError",
    "check_archive",
    "is_checkpoint_dir",
    "load_checkpoint",
    "load_model",
    "model_from_checkpoint",
    "recorded_data_source",
    "save_checkpoint",
    "state_of",
]

FORMAT_VERSION = 1
MODEL_FILE, CONFIG_FILE, VOCAB_FILE = "model.pt", "config.json", "vocab.json"
TRAIN_METRICS_FILE, CURVES_FILE = "train_metrics.json", "curves.csv"  # training summary, curves
LAST_STATE_FILE = "last_state.pt"  # the last epoch's training state, to resume from
# Bounds far above the paper's sizes (n = 1800, K ≈ 10k words, L = 196): a config beyond them is
# malformed, not large, and is refused before anything is sized from it.
MAX_DIM = 1 << 16
MAX_VOCAB = 1 << 22
_NONE = type(None)
# what a sat payload holds (extra keys are allowed: later formats add sections)
_PAYLOAD_TYPES: dict[str, tuple[type, ...]] = {
    "model_state": (dict,),
    "criterion_state": (dict,),
    "optimizer_state": (dict, _NONE),
    "scheduler_state": (dict, _NONE),
    "epoch": (int,),
    "best_score": (float, int, _NONE),
    "best_epoch": (int, _NONE),
    "config": (dict,),
    "itos": (list,),
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, from another vocabulary, or carries pickled code."""


@dataclass(frozen=True)
class Checkpoint:
    """Everything in a checkpoint folder, loaded and cross-checked."""

    model_config: ModelConfig
    vocab: Vocab
    model_state: dict[str, torch.Tensor]
    criterion_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    epoch: int  # epochs completed when saved
    best_score: float | None  # best validation score so far (BLEU-4)
    best_epoch: int | None
    config: dict[str, Any]  # the whole config.json: model, encoder, train, ...
    format_version: int = FORMAT_VERSION
    # the optimiser's weights when model_state is their moving average (to resume); else None
    train_state: dict[str, torch.Tensor] | None = None


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
    train_state: Mapping[str, torch.Tensor] | None = None,
    criterion_state: Mapping[str, torch.Tensor] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    scheduler_state: Mapping[str, Any] | None = None,
    epoch: int = 0,
    best_score: float | None = None,
    best_epoch: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model.pt``, ``config.json`` and ``vocab.json`` under ``directory``; return it.

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
    payload = {
        "format_version": FORMAT_VERSION,
        "model_state": _cpu(model_state),
        "train_state": _cpu(train_state) if train_state is not None else None,
        "criterion_state": _cpu(criterion_state or {}),
        "optimizer_state": _cpu(optimizer_state) if optimizer_state is not None else None,
        "scheduler_state": dict(scheduler_state) if scheduler_state is not None else None,
        "epoch": int(epoch),
        "best_score": None if best_score is None else float(best_score),
        "best_epoch": None if best_epoch is None else int(best_epoch),
        "config": json.loads(json.dumps(config)),  # plain containers only (weights_only)
        "itos": list(vocab.itos),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_text_atomic(directory / CONFIG_FILE, json.dumps(config, indent=1) + "\n")
    save_vocab(vocab, directory / VOCAB_FILE)
    write_bytes_atomic(directory / MODEL_FILE, buffer.getvalue())  # last: the commit point
    return directory


def load_checkpoint(
    directory: str | Path, vocab: Vocab | None = None, map_location: str = "cpu"
) -> Checkpoint:
    """Read and cross-check a checkpoint folder; :class:`CheckpointError` says what is wrong.

    ``vocab``, when given, must be the checkpoint's vocabulary (e.g. the prepared data's).
    """
    directory = Path(directory)
    payload = _load_payload(directory / MODEL_FILE, map_location)
    if payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory / MODEL_FILE}: format_version {payload.get('format_version')!r}, "
            f"this code reads {FORMAT_VERSION}"
        )
    _check_payload_types(payload, directory / MODEL_FILE)
    model_config = _model_config(payload["config"].get("model"), directory)
    _check_shapes(model_config, payload["model_state"], directory / MODEL_FILE, "model_state")
    if payload.get("train_state") is not None:
        _check_shapes(model_config, payload["train_state"], directory / MODEL_FILE, "train_state")
    file_vocab = _check_vocab(directory, payload["itos"], model_config, vocab)
    _check_config_json(directory, payload["config"])
    return Checkpoint(
        model_config=model_config,
        vocab=file_vocab,
        model_state=payload["model_state"],
        criterion_state=payload["criterion_state"],
        optimizer_state=payload["optimizer_state"],
        scheduler_state=payload["scheduler_state"],
        epoch=payload["epoch"],
        best_score=payload["best_score"],
        best_epoch=payload["best_epoch"],
        config=payload["config"],
        train_state=payload.get("train_state"),  # absent in checkpoints written before it
    )


def load_model(
    directory: str | Path, device: str | torch.device = "cpu"
) -> tuple[ShowAttendTell, Vocab, ModelConfig]:
    """Rebuild the model from the folder alone, in eval mode, on ``device``."""
    return model_from_checkpoint(load_checkpoint(directory), device, source=directory)


def model_from_checkpoint(
    ckpt: Checkpoint, device: str | torch.device = "cpu", source: str | Path = "checkpoint"
) -> tuple[ShowAttendTell, Vocab, ModelConfig]:
    """The model of a loaded checkpoint, in eval mode, on ``device`` (``source`` names it)."""
    model = ShowAttendTell(ckpt.model_config)
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


def _load_payload(path: Path, map_location: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    check_archive(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e):
            raise CheckpointError(
                f"refusing to unpickle code from {path}: it holds objects other than tensors "
                f"and plain containers (e.g. a pickled nn.Module or custom class); "
                f"only state_dict checkpoints are loaded"
            ) from None
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    if not isinstance(payload, dict) or "model_state" not in payload:
        raise CheckpointError(f"{path} is not a sat checkpoint (no model_state)")
    return payload


def check_archive(path: Path) -> None:
    """Refuse a file that is not an intact torch zip archive (:class:`CheckpointError`).

    torch.load does not verify the archive's CRCs: a flipped byte inside a tensor would load
    silently as a different weight, so every member is checked first."""
    if not zipfile.is_zipfile(path):  # torch.save always writes a zip archive
        raise CheckpointError(f"{path} is corrupted: not a torch zip archive")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    if bad is not None:
        raise CheckpointError(f"{path} is corrupted: checksum mismatch in {bad}")


def _check_payload_types(payload: dict[str, Any], path: Path) -> None:
    for key, types in _PAYLOAD_TYPES.items():
        if key not in payload:
            raise CheckpointError(f"{path} is not a sat checkpoint: no {key!r}")
        value = payload[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("None" if t is _NONE else t.__name__ for t in types)
            raise CheckpointError(f"{path}: {key} is {type(value).__name__}, expected {names}")
    if not all(isinstance(w, str) for w in payload["itos"]):
        raise CheckpointError(f"{path}: itos holds a non-string word")
    train_state = payload.get("train_state")
    for key, state in (("model_state", payload["model_state"]), ("train_state", train_state)):
        if state is not None and not (
            isinstance(state, dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
        ):
            raise CheckpointError(f"{path}: {key} is not a mapping of names to tensors")


def _field_error(name: str, kind: str, value: Any) -> str:
    """Why ``value`` cannot be the ``ModelConfig`` field ``name`` of type ``kind``, or ""."""
    if kind == "bool":
        return "" if isinstance(value, bool) else "must be true or false"
    if kind == "str":
        return "" if isinstance(value, str) else "must be a string"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, not {type(value).__name__}"
    if kind == "float":
        return "" if math.isfinite(value) else "must be finite"
    if not isinstance(value, int):
        return "must be an integer"
    low = 0 if name == "grid_w" else 1
    high = MAX_VOCAB if name == "vocab_size" else MAX_DIM
    return "" if low <= value <= high else f"must be in [{low}, {high}]"


def _model_config(raw: Any, directory: Path) -> ModelConfig:
    """A ``ModelConfig`` from the saved dict, every field type- and bound-checked first."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{directory}: the model config is {type(raw).__name__}, not a dict")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - set(fields))
    missing = [n for n, f in fields.items() if n not in raw and _required(f)]
    if unknown or missing:
        raise CheckpointError(
            f"{directory}: invalid model config: unknown keys {unknown}, missing keys {missing}"
        )
    for name, value in raw.items():
        kind = fields[name].type
        why = _field_error(name, kind if isinstance(kind, str) else kind.__name__, value)
        if why:
            raise CheckpointError(f"{directory}: invalid model config: {name}={value!r} {why}")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{directory}: invalid model config {raw!r}: {e}") from e


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _check_shapes(
    config: ModelConfig, state: Mapping[str, torch.Tensor], path: Path, what: str
) -> None:
    """Every tensor of ``state`` has the name and shape ``config`` implies, checked on a model
    built on the meta device (shapes only: nothing is allocated, whatever the config says)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ShowAttendTell(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    ]
    problems = [f"missing {missing[:5]}"] if missing else []
    problems += [f"unexpected {unexpected[:5]}"] if unexpected else []
    problems += [f"shapes {wrong[:5]}"] if wrong else []
    if problems:
        raise CheckpointError(
            f"{path}: {what} does not fit the saved model config: {'; '.join(problems)}"
        )


def _check_vocab(
    directory: Path, itos: list[str], config: ModelConfig, given: Vocab | None
) -> Vocab:
    try:
        on_disk = load_vocab(directory / VOCAB_FILE)
    except VocabError as e:
        raise CheckpointError(f"{directory}: {e}") from e
    if list(on_disk.itos) != list(itos):
        raise CheckpointError(
            f"{directory / VOCAB_FILE} ({len(on_disk)} words) is not the vocabulary "
            f"{MODEL_FILE} was trained with ({len(itos)} words)"
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


def _check_config_json(directory: Path, config: dict[str, Any]) -> None:
    try:
        on_disk = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {directory / CONFIG_FILE}: {e}") from e
    if on_disk != config:
        raise CheckpointError(f"{directory / CONFIG_FILE} does not match {MODEL_FILE}")


def is_checkpoint_dir(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint sat wrote: ``model.pt`` beside a ``config.json``
    with sat's keys (the test for "ours" before a model folder is replaced)."""
    directory = Path(directory)
    if not (directory / MODEL_FILE).is_file():
        return False
    try:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "format_version" in config and "model" in config


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``module.state_dict()`` (kept as the best model while training)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
