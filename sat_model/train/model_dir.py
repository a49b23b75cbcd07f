"""The model folder a training run writes, on rank 0, after every epoch: the best checkpoint
(:mod:`sat_model.model.checkpoint`), ``train_metrics.json`` (flat keys), ``curves.csv`` (for
``dvc plots``) and ``last_state.pt``, the last epoch's training state, written last."""

from __future__ import annotations

import csv
import io
import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sat_model.atomic import write_bytes_atomic, write_text_atomic
from sat_model.data.vocab import Vocab
from sat_model.model.checkpoint import (
    CURVES_FILE,
    LAST_STATE_FILE,
    TRAIN_METRICS_FILE,
    CheckpointError,
    TrainingState,
    check_archive,
    is_checkpoint_dir,
    save_checkpoint,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.train.phases import LIKELIHOOD
from sat_model.train.trainer import Callback, EpochState

__all__ = [
    "CURVE_COLUMNS",
    "CURVE_KEYS",
    "ModelDirWriter",
    "curve_columns",
    "curve_keys",
    "load_training_state",
    "read_curves",
    "read_metrics",
    "save_training_state",
]

LAST_STATE_VERSION = 1
CURVE_KEYS = ("bleu_4", "cider")  # the validation scores every curves.csv holds


def curve_keys(monitor: str = "bleu_4") -> tuple[str, ...]:
    """The validation keys a run's curves hold: :data:`CURVE_KEYS` and ``train.monitor``."""
    return CURVE_KEYS if monitor in CURVE_KEYS else (*CURVE_KEYS, monitor)


def curve_columns(monitor: str = "bleu_4") -> tuple[str, ...]:
    """The columns of ``curves.csv`` (``dvc plots`` draws each against the epoch)."""
    return ("epoch", "train_loss", *(f"val_{k}" for k in curve_keys(monitor)), "lr")


CURVE_COLUMNS = curve_columns()  # with the default monitor


class ModelDirWriter(Callback):
    """Rank 0: the best checkpoint, metrics and curves under ``model_dir`` after each epoch."""

    def __init__(
        self,
        model_dir: Path,
        model: ShowAttendTell,
        vocab: Vocab,
        extra_config: dict[str, Any],
        curves: list[dict[str, Any]],
        counts: dict[str, float],
        monitor: str = "bleu_4",
    ) -> None:
        self.model_dir, self.model, self.vocab = model_dir, model, vocab
        self.extra_config, self.curves, self.counts = extra_config, curves, counts
        self.keys = curve_keys(monitor)
        self.phase = LIKELIHOOD  # recorded in last_state.pt (train_model sets it per phase)

    def on_epoch_end(self, state: EpochState) -> None:
        snapshot = state.checkpoint()
        if state.is_best:
            save_checkpoint(
                self.model_dir,
                model_config=self.model.config,
                vocab=self.vocab,
                model_state=snapshot["model_state"],
                training=TrainingState(**{k: v for k, v in snapshot.items() if k != "model_state"}),
                extra_config=self.extra_config,
            )
        val = state.val_metrics or {}
        scores = {f"val_{k}": val.get(k) for k in self.keys}
        self.curves.append(
            {"epoch": state.epoch, "train_loss": state.train_loss, **scores, "lr": state.lr}
        )
        columns = ("epoch", "train_loss", *scores, "lr")
        _write_curves(self.model_dir / CURVES_FILE, self.curves, columns)
        metrics = _train_metrics(state, self.curves, self.counts, self.keys)
        write_text_atomic(self.model_dir / TRAIN_METRICS_FILE, json.dumps(metrics, indent=1) + "\n")
        # last: a crash before this leaves the previous epoch's state, which a resume repeats from
        save_training_state(self.model_dir / LAST_STATE_FILE, {**snapshot, "phase": self.phase})


def save_training_state(path: Path, snapshot: Mapping[str, Any]) -> None:
    """Write ``snapshot`` (``EpochState.checkpoint()``) and the torch RNG states to ``path``
    atomically: plain containers and tensors only, read back with ``weights_only=True``."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    payload = {"format_version": LAST_STATE_VERSION, **_to_cpu(dict(snapshot)), "rng_state": rng}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def load_training_state(path: Path) -> dict[str, Any]:
    """Read a file written by :func:`save_training_state`; :class:`CheckpointError` if it is not
    one (missing, corrupted, another format)."""
    check_archive(path)  # torch.load does not check the zip's CRCs (best_state.pt gets the same)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"cannot read the training state {path}: {e}") from None
    if not isinstance(payload, dict) or payload.get("format_version") != LAST_STATE_VERSION:
        raise CheckpointError(f"{path} is not a training state this code reads")
    missing = {"model_state", "optimizer_state", "epoch"} - payload.keys()
    if missing:
        raise CheckpointError(f"{path} lacks {sorted(missing)}")
    return payload


def _to_cpu(value: Any) -> Any:
    # the state must load on a machine without the GPU it was trained on
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _write_curves(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, buffer.getvalue())


def read_curves(path: Path, up_to_epoch: int) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        if int(row["epoch"]) <= up_to_epoch:
            scores = {k: _optional_float(v) for k, v in row.items() if k.startswith("val_")}
            out.append(
                {
                    "epoch": int(row["epoch"]),
                    "train_loss": float(row["train_loss"]),
                    **scores,
                    "lr": float(row["lr"]),
                }
            )
    return out


def _optional_float(text: str | None) -> float | None:
    return float(text) if text else None


def _train_metrics(
    state: EpochState,
    curves: list[dict[str, Any]],
    counts: dict[str, float],
    keys: tuple[str, ...],
) -> dict[str, float]:
    """Flat keys for ``dvc metrics``: the best epoch's validation scores of ``keys`` (BLEU-4,
    CIDEr and ``train.monitor``, which picked it), the last epoch's loss."""
    best = next((c for c in curves if c["epoch"] == state.best_epoch), curves[-1])
    metrics: dict[str, float] = {
        "best_epoch": state.best_epoch or state.epoch,
        "epochs": state.epoch,
        "final_train_loss": state.train_loss,
        "final_train_nll": state.train_nll,
        "final_lr": state.lr,
        "best_train_loss": best["train_loss"],
    }
    if state.best_score is not None:
        metrics.update({f"best_val_{k}": best[f"val_{k}"] for k in keys if f"val_{k}" in best})
    if state.val_metrics:
        metrics.update({f"final_val_{k}": v for k, v in state.val_metrics.items()})
    metrics.update(counts)
    return metrics


def read_metrics(model_dir: Path) -> dict[str, float]:
    path = model_dir / TRAIN_METRICS_FILE
    if not is_checkpoint_dir(model_dir) or not path.is_file():
        return {}
    metrics: dict[str, float] = json.loads(path.read_text(encoding="utf-8"))
    return metrics
