"""The checks that a model folder's files pass before anything is built from them: they come
from outside (a download, a copy, a registry), so every payload is read without running code
(``torch.load(weights_only=True)`` after the zip CRCs), every type and bound is checked, and every
tensor shape is compared with the saved config on the meta device. A failure is a
:class:`CheckpointError` with one line saying what is wrong."""

from __future__ import annotations

import dataclasses
import math
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sat_model.model.decoder import ModelConfig, ShowAttendTell

__all__ = [
    "MAX_DIM",
    "MAX_VOCAB",
    "NONE",
    "CheckpointError",
    "check_archive",
    "check_shapes",
    "check_tensors",
    "check_types",
    "check_version",
    "load_pt",
    "model_config",
]

# Bounds far above the paper's sizes (n = 1800, K ≈ 10k words, L = 196): a config beyond them is
# malformed, not large, and is refused before anything is sized from it.
MAX_DIM = 1 << 16
MAX_VOCAB = 1 << 22
NONE = type(None)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, from another vocabulary, or carries pickled code."""


def load_pt(path: Path, map_location: str, what: str) -> dict[str, Any]:
    """A ``torch.save`` dict of plain containers and tensors (``best_state.pt``, format 1's
    ``model.pt``), its zip CRCs checked first; pickled code is refused."""
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
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
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not a sat {what} (not a dict)")
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


def check_version(found: Any, expected: int, path: Path) -> None:
    # safetensors metadata holds strings: "2" there is 2 in a torch.save payload
    if found not in (expected, str(expected)) or isinstance(found, bool):
        raise CheckpointError(f"{path}: format_version {found!r}, this code reads {expected}")


def check_types(payload: Mapping[str, Any], path: Path, types: dict[str, tuple[type, ...]]) -> None:
    """Every key of ``types`` is in ``payload`` with one of its types (bool is not an int)."""
    for key, allowed in types.items():
        if key not in payload:
            raise CheckpointError(f"{path} is not a sat checkpoint: no {key!r}")
        value = payload[key]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join("None" if t is NONE else t.__name__ for t in allowed)
            raise CheckpointError(f"{path}: {key} is {type(value).__name__}, expected {names}")
    if "itos" in types and not all(isinstance(w, str) for w in payload["itos"]):
        raise CheckpointError(f"{path}: itos holds a non-string word")
    if "model_state" in types:
        check_tensors(payload["model_state"], path, "model_state")


def check_tensors(state: Any, path: Path, what: str) -> None:
    if not (
        isinstance(state, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise CheckpointError(f"{path}: {what} is not a mapping of names to tensors")


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


def model_config(raw: Any, directory: Path) -> ModelConfig:
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


class _NoNormalInit(TorchFunctionMode):
    """Skips ``normal_`` (``nn.Embedding``'s initialiser): on the meta device it computes nothing,
    yet runs one of PyTorch's Python decompositions, whose first call imports the compiler and
    sympy, a second of CPU in every process that loads a model."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_ or func is torch.Tensor.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def check_shapes(
    config: ModelConfig, state: Mapping[str, torch.Tensor], path: Path, what: str
) -> None:
    """Every tensor of ``state`` has the name and shape ``config`` implies, checked on a model
    built on the meta device (shapes only: nothing is allocated, whatever the config says)."""
    with torch.device("meta"), _NoNormalInit():
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
