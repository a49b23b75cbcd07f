"""One machine's training run: params + prepared data + features -> a trained model folder.

``train_model`` is what ``sat train`` runs in-process and what every Ray Train worker runs with
its ``rank``/``world_size``; it builds everything from files (``vocab.json``,
``captions.parquet``, ``{train,val}.arrow``) and, on rank 0, writes ``<out_dir>/<attention>/``:
the best epoch so far (``model.safetensors`` + ``config.json`` + ``vocab.json`` +
``best_state.pt``, see :mod:`sat_model.model.checkpoint`; rewritten whenever validation BLEU-4
improves), ``train_metrics.json`` (flat keys) and ``curves.csv`` (epoch, train_loss, val_bleu_4,
val_cider, the monitored score, lr; for ``dvc plots``), both rewritten every epoch, and
``last_state.pt``, the last epoch's training state (weights, moving average, criterion state with
the hard-attention baseline, optimiser, scheduler, torch RNG states, epoch, best score), rewritten
atomically every epoch after the other files. The folder is complete after every epoch, so a
callback may hand it to Ray as that epoch's checkpoint: the folder is written before the caller's
callbacks run. A run resumed from such a folder continues from the last epoch (``last_state.pt``);
the best checkpoint beside it stays the best until a later epoch beats it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sat_model.config import ATTENTION_KINDS, LibraryParams
from sat_model.data.tables import CAPTIONS_FILE, load_references
from sat_model.features.drift import fit_stores
from sat_model.features.store import FeatureStore, store_file
from sat_model.model.checkpoint import CURVES_FILE
from sat_model.model.decoding import decode_mode
from sat_model.train.model_dir import (
    ModelDirWriter,
    load_training_state,
    read_curves,
    read_metrics,
    save_training_state,
)
from sat_model.train.phases import (
    Setup,
    fit_options,
    likelihood_phase,
    run_phases,
    self_critical_phase,
    semi_sampling_options,
    set_up,
)
from sat_model.train.resume import resume_run
from sat_model.train.trainer import Callback, ResumeState
from sat_model.train.validation import (
    VALIDATION_METRICS,
    ValidationOptions,
    make_validator,
    validation_metrics,
)

__all__ = [
    "VALIDATION_METRICS",
    "TrainFolders",
    "TrainResult",
    "Worker",
    "load_training_state",
    "make_validator",
    "save_training_state",
    "semi_sampling_options",
    "train_model",
]


@dataclass(frozen=True)
class TrainFolders:
    """Where a run reads its inputs and writes its model folder (``<out_dir>/<attention>/``)."""

    prepared_dir: Path  # data/prepared: vocab.json, captions.parquet
    features_dir: Path  # data/features: {train,val}.arrow
    out_dir: Path  # models/


@dataclass(frozen=True)
class Worker:
    """The process that trains: one of ``world_size`` ranks, on ``device`` (None: a GPU where
    there is one), with ``wrap_model`` wrapping the model for the forward pass (DDP)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | str | None = None
    wrap_model: Callable[[nn.Module], nn.Module] | None = None


@dataclass(frozen=True)
class TrainResult:
    model_dir: Path  # <out_dir>/<attention>
    metrics: dict[str, float]  # what train_metrics.json holds
    best_epoch: int | None
    epochs_completed: int
    stopped_early: bool


def train_model(
    params: LibraryParams,
    attention: str,
    folders: TrainFolders,
    *,
    worker: Worker = Worker(),
    callbacks: Sequence[Callback] = (),
    resume_from: str | Path | None = None,
    identity: str | None = None,
    log_every: int = 50,
) -> TrainResult:
    """Train ``attention`` ("soft" | "hard") and write ``<out_dir>/<attention>/`` (rank 0).

    ``identity`` (the run's digest, see ``pipeline.tracking.run_identity``) is recorded in
    ``config.json``; ``log_every`` is how often callbacks get ``on_log`` (steps).
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
    prepared_dir, features_dir = Path(folders.prepared_dir), Path(folders.features_dir)
    rank, wrap_model = worker.rank, worker.wrap_model
    setup = set_up(
        params,
        attention,
        prepared_dir,
        features_dir,
        Path(folders.out_dir),
        rank,
        worker.world_size,
        worker.device,
    )
    phases = [likelihood_phase(setup)]
    if setup.cfg.scst_epochs > 0:
        phases.append(self_critical_phase(params, setup))
    resume, curves, first = ResumeState(), [], 0
    if resume_from is not None:
        resume, first = resume_run(Path(resume_from), setup, phases)
        curves = read_curves(Path(resume_from) / CURVES_FILE, resume.epoch)
    validate, writers = None, []
    if rank == 0:
        validate, writer = _rank_zero(params, setup, prepared_dir, features_dir, curves, identity)
        writers = [writer]
    options = functools.partial(fit_options, params, setup, rank, log_every)
    result = run_phases(
        setup, phases[first:], resume, validate, options, writers, callbacks, wrap_model
    )
    metrics = read_metrics(setup.model_dir) if rank == 0 else {}
    return TrainResult(
        setup.model_dir, metrics, result.best_epoch, result.epochs_completed, result.stopped_early
    )


def _rank_zero(
    params: LibraryParams,
    setup: Setup,
    prepared_dir: Path,
    features_dir: Path,
    curves: list[dict[str, Any]],
    identity: str | None,
) -> tuple[Callable[[nn.Module], dict[str, float]], ModelDirWriter]:
    """Rank 0's ``validate(model)`` (first ``train.val_images`` validation images) and the
    callback writing the model folder."""
    val_store = FeatureStore(features_dir / store_file("val"))
    options = ValidationOptions(
        max_images=params.train.val_images,
        max_length=params.train.val_max_length,
        batch_size=params.eval.batch_size,
        mode=decode_mode(params.eval.hard_decode, setup.attention),
        metrics=validation_metrics(params.train.monitor),
    )
    references = load_references(prepared_dir / CAPTIONS_FILE, "val")
    validate = make_validator(val_store, references, setup.vocab, setup.device, options)
    counts: dict[str, float] = {
        "train_captions": len(setup.dataset),
        "skipped_captions": setup.skipped,
        "val_images": min(len(val_store), params.train.val_images or len(val_store)),
        "world_size": setup.sampler.num_replicas,
    }
    extra_config = {
        "attention": setup.attention,
        # the store records the crop (input_size); the shorter-side resize that preceded it is
        # needed to preprocess new images the same way (sat caption, the served model)
        "encoder": replace(
            setup.train_store.spec,
            resize=params.encoder.resize,
            keep_aspect=params.encoder.keep_aspect,
        ).to_config(),
        "train": {"seed": params.train.seed, **setup.cfg.model_dump()},
        # what the model knows: the scenes' shapes or photos (sat caption and sat serve say so)
        "data": {"source": params.data.source},
        # what trained it, for the model card
        "hardware": {"device": describe_device(setup.device)},
    }
    if identity is not None:
        extra_config["identity"] = identity
    drift = fit_stores(setup.train_store, val_store)  # how far new photos are (sat caption)
    if drift is not None:
        extra_config["drift"] = drift.to_config()
    writer = ModelDirWriter(
        setup.model_dir,
        setup.model,
        setup.vocab,
        extra_config,
        curves,
        counts,
        monitor=params.train.monitor,
    )
    return validate, writer


def describe_device(device: torch.device) -> str:
    """``cuda (<its name>)`` or ``cpu (<N> threads)``: the device one rank trained on."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"{device.type} ({threads} thread{'s' if threads > 1 else ''})"
