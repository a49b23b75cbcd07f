"""One machine's training run: params + prepared data + features -> a trained model folder.

``train_model`` is what ``sat train`` runs in-process and what every Ray Train worker runs with
its ``rank``/``world_size``; it builds everything from files (``vocab.json``,
``captions.parquet``, ``{train,val}.arrow``) and, on rank 0, writes ``<out_dir>/<attention>/``:
the best epoch so far (``model.safetensors`` + ``config.json`` + ``vocab.json`` +
``best_state.pt``, see :mod:`sat_model.model.checkpoint`; rewritten whenever validation BLEU-4
improves), ``train_metrics.json`` (flat keys) and ``curves.csv`` (epoch, train_loss, val_bleu_4,
val_cider, lr; for ``dvc plots``), both rewritten every epoch, and
``last_state.pt``, the last epoch's training state (weights, moving average, criterion state with
the hard-attention baseline, optimiser, scheduler, torch RNG states, epoch, best score), rewritten
atomically every epoch after the other files. The folder is complete after every epoch, so a
callback may hand it to Ray as that epoch's checkpoint: the folder is written before the caller's
callbacks run. A run resumed from such a folder continues from the last epoch (``last_state.pt``);
the best checkpoint beside it stays the best until a later epoch beats it.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sat_model.atomic import write_bytes_atomic, write_text_atomic
from sat_model.config import ATTENTION_KINDS, Params
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE, load_references
from sat_model.data.vocab import Vocab, load_vocab
from sat_model.evaluation.metrics import score_captions
from sat_model.features.drift import fit_stores
from sat_model.features.store import (
    FeatureStore,
    FeatureStoreError,
    channel_statistics,
    store_file,
)
from sat_model.model.checkpoint import (
    CURVES_FILE,
    LAST_STATE_FILE,
    TRAIN_METRICS_FILE,
    CheckpointError,
    check_archive,
    is_checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import decode_mode, greedy
from sat_model.model.factory import build_model
from sat_model.model.losses import SelfCriticalLoss, build_criterion
from sat_model.train.batching import (
    Batch,
    CaptionDataset,
    LengthGroupedBatchSampler,
    load_caption_dataset,
    mirror_draws,
)
from sat_model.train.self_critical import (
    ImageBatches,
    Reward,
    references_by_image,
    self_critical_step,
)
from sat_model.train.trainer import (
    Callback,
    EpochState,
    FitOptions,
    ResumeState,
    build_optimizer,
    build_scheduler,
    fit,
)

__all__ = [
    "VALIDATION_METRICS",
    "TrainResult",
    "load_training_state",
    "make_validator",
    "save_training_state",
    "semi_sampling_options",
    "train_model",
]

LAST_STATE_VERSION = 1
CURVE_COLUMNS = ("epoch", "train_loss", "val_bleu_4", "val_cider", "lr")
# BLEU drives early stopping; CIDEr is logged beside it (no Java, milliseconds on val_images)
VALIDATION_METRICS = ("bleu", "cider")


@dataclass(frozen=True)
class TrainResult:
    model_dir: Path  # <out_dir>/<attention>
    metrics: dict[str, float]  # what train_metrics.json holds
    best_epoch: int | None
    epochs_completed: int
    stopped_early: bool


class _EpochBatches:
    """This rank's batches of one epoch, collated lazily from the memory-mapped store; items
    where ``mirror`` (N,) is true come mirrored."""

    def __init__(
        self, dataset: CaptionDataset, batches: list[list[int]], mirror: np.ndarray | None
    ) -> None:
        self.dataset, self.batches, self.mirror = dataset, batches, mirror

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        if self.mirror is None:
            return (self.dataset.collate(b) for b in self.batches)
        mirror = self.mirror
        return (self.dataset.collate(b, mirror[b]) for b in self.batches)


def make_validator(
    store: FeatureStore,
    references: dict[str, list[str]],
    vocab: Vocab,
    *,
    max_images: int,
    max_length: int,
    batch_size: int,
    device: torch.device | str,
    mode: str = "expected",
) -> Callable[[nn.Module], dict[str, float]]:
    """``validate(model)``: BLEU and CIDEr of free-running greedy captions on the first val
    images, by ``metrics.score_captions(..., metrics=VALIDATION_METRICS)``, the evaluation's own
    scorer (CIDEr's idf comes from these images' references only, so it is comparable across
    epochs of one run, not with the test-set figure).
    """
    ids = [i for i in store.ids if i in references]
    ids = ids[:max_images] if max_images > 0 else ids
    if not ids:
        raise ValueError("no validation image has both features and reference captions")
    rows = [store.index_of(i) for i in ids]
    refs = {i: references[i] for i in ids}

    def validate(model: nn.Module) -> dict[str, float]:
        assert isinstance(model, ShowAttendTell)  # fit validates the model it was given
        hypotheses: dict[str, str] = {}
        for start in range(0, len(rows), batch_size):
            feats = store.get_batch(rows[start : start + batch_size])  # (B, L, D) float16
            annotations = torch.from_numpy(feats).to(device, torch.float32)  # (B, L, D)
            captions = greedy(model, annotations, max_length, mode=mode)
            for image_id, caption in zip(ids[start : start + batch_size], captions, strict=True):
                hypotheses[image_id] = " ".join(vocab.decode(caption.tokens))
        return score_captions(hypotheses, refs, metrics=VALIDATION_METRICS)

    return validate


class _ModelDirWriter(Callback):
    """Rank 0: the best checkpoint, metrics and curves under ``model_dir`` after each epoch."""

    def __init__(
        self,
        model_dir: Path,
        model: ShowAttendTell,
        vocab: Vocab,
        extra_config: dict[str, Any],
        curves: list[dict[str, Any]],
        counts: dict[str, float],
    ) -> None:
        self.model_dir, self.model, self.vocab = model_dir, model, vocab
        self.extra_config, self.curves, self.counts = extra_config, curves, counts
        self.phase = LIKELIHOOD  # recorded in last_state.pt (train_model sets it per phase)

    def on_epoch_end(self, state: EpochState) -> None:
        snapshot = state.checkpoint()
        if state.is_best:
            save_checkpoint(
                self.model_dir,
                model_config=self.model.config,
                vocab=self.vocab,
                extra_config=self.extra_config,
                **snapshot,
            )
        val = state.val_metrics or {}
        self.curves.append(
            {
                "epoch": state.epoch,
                "train_loss": state.train_loss,
                "val_bleu_4": val.get("bleu_4"),
                "val_cider": val.get("cider"),
                "lr": state.lr,
            }
        )
        _write_curves(self.model_dir / CURVES_FILE, self.curves)
        metrics = _train_metrics(state, self.curves, self.counts)
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


def _write_curves(path: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CURVE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, buffer.getvalue())


def _read_curves(path: Path, up_to_epoch: int) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        if int(row["epoch"]) <= up_to_epoch:
            out.append(
                {
                    "epoch": int(row["epoch"]),
                    "train_loss": float(row["train_loss"]),
                    "val_bleu_4": _optional_float(row.get("val_bleu_4")),
                    "val_cider": _optional_float(row.get("val_cider")),  # absent in older files
                    "lr": float(row["lr"]),
                }
            )
    return out


def _optional_float(text: str | None) -> float | None:
    return float(text) if text else None


def _train_metrics(
    state: EpochState, curves: list[dict[str, Any]], counts: dict[str, float]
) -> dict[str, float]:
    """Flat keys for ``dvc metrics``: the best epoch's validation BLEU-4 and CIDEr (whichever
    ``train.monitor`` picked it by), the last epoch's loss."""
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
        metrics["best_val_bleu_4"] = best["val_bleu_4"]
        metrics["best_val_cider"] = best["val_cider"]
    if state.val_metrics:
        metrics.update({f"final_val_{k}": v for k, v in state.val_metrics.items()})
    metrics.update(counts)
    return metrics


@dataclass(frozen=True)
class _Setup:
    """What one rank trains, built from the files before the first epoch (internal)."""

    attention: str
    cfg: Any  # params.train.soft or params.train.hard
    device: torch.device
    model_dir: Path  # <out_dir>/<attention>
    vocab: Vocab
    train_store: FeatureStore
    dataset: CaptionDataset
    skipped: int  # captions left out of the dataset
    sampler: LengthGroupedBatchSampler
    mirror: float  # train.mirror: each caption's chance, per epoch, of its mirrored photo
    model: ShowAttendTell
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def batches(self, epoch: int) -> _EpochBatches:
        mirror = None
        if self.mirror > 0:
            mirror = mirror_draws(len(self.dataset), self.mirror, self.sampler.seed, epoch)
        return _EpochBatches(self.dataset, self.sampler.batches(epoch), mirror)


def _run_phases(
    setup: _Setup,
    phases: Sequence[_Phase],
    resume: ResumeState,
    validate: Any,
    options: Callable[[int], Any],
    writers: list[Any],
    callbacks: Sequence[Callback],
    wrap_model: Callable[[nn.Module], nn.Module] | None,
) -> Any:
    """Fit each phase in turn, the next from the best weights of the one before; the last
    phase's fit result."""
    for phase in phases:
        for writer in writers:
            writer.phase = phase.name
        result = fit(
            setup.model,
            phase.criterion,
            phase.optimizer,
            phase.scheduler,
            phase.batches,
            validate,
            options(phase.max_epochs),
            [*writers, *callbacks],
            resume=resume,
            wrap_model=wrap_model,
            step_loss=phase.step_loss,
        )
        # the next phase starts from the best weights, which fit leaves in the model
        resume = ResumeState(
            epoch=result.epochs_completed,
            best_score=result.best_score,
            best_epoch=result.best_epoch,
            best_state=result.best_state,
        )
        if result.stopped_early:
            break
    return result


def train_model(
    params: Params,
    attention: str,
    prepared_dir: str | Path,
    features_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
    callbacks: Sequence[Callback] = (),
    resume_from: str | Path | None = None,
    wrap_model: Callable[[nn.Module], nn.Module] | None = None,
    identity: str | None = None,
    log_every: int = 50,
) -> TrainResult:
    """Train ``attention`` ("soft" | "hard") and write ``<out_dir>/<attention>/`` (rank 0).

    ``identity`` (the run's digest, see ``pipeline.tracking.run_identity``) is recorded in
    ``config.json``; ``log_every`` is how often callbacks get ``on_log`` (steps).
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
    prepared_dir, features_dir = Path(prepared_dir), Path(features_dir)
    setup = _set_up(
        params, attention, prepared_dir, features_dir, Path(out_dir), rank, world_size, device
    )
    phases = [_likelihood_phase(setup)]
    if setup.cfg.scst_epochs > 0:
        phases.append(_self_critical_phase(params, setup))
    resume, curves, first = ResumeState(), [], 0
    if resume_from is not None:
        resume, first = _resume(Path(resume_from), setup, phases)
        curves = _read_curves(Path(resume_from) / CURVES_FILE, resume.epoch)
    validate, writers = None, []
    if rank == 0:
        validate, writer = _rank_zero(params, setup, prepared_dir, features_dir, curves, identity)
        writers = [writer]
    options = functools.partial(_fit_options, params, setup, rank, log_every)
    result = _run_phases(
        setup, phases[first:], resume, validate, options, writers, callbacks, wrap_model
    )
    metrics = _read_metrics(setup.model_dir) if rank == 0 else {}
    return TrainResult(
        setup.model_dir, metrics, result.best_epoch, result.epochs_completed, result.stopped_early
    )


def _set_up(
    params: Params,
    attention: str,
    prepared_dir: Path,
    features_dir: Path,
    out_dir: Path,
    rank: int,
    world_size: int,
    device: torch.device | str | None,
) -> _Setup:
    """Vocabulary, this rank's shard of the training captions, the model and its optimiser."""
    cfg = params.train.soft if attention == "soft" else params.train.hard
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vocab = load_vocab(prepared_dir / VOCAB_FILE)
    store = FeatureStore(features_dir / store_file("train"))
    mirrored = None
    if params.train.mirror > 0:  # the extract stage's, with encoder.mirror_train
        mirrored = FeatureStore(features_dir / store_file("train", mirrored=True))
        if mirrored.spec != store.spec:
            raise FeatureStoreError(f"{mirrored.path}: not train.arrow's encoder; re-extract")
    dataset, skipped = load_caption_dataset(
        prepared_dir / CAPTIONS_FILE, "train", store, vocab, mirrored
    )
    sampler = LengthGroupedBatchSampler(
        dataset.lengths, cfg.batch_size, seed=params.train.seed, num_replicas=world_size, rank=rank
    )
    torch.manual_seed(params.train.seed)  # same initial weights on every rank and every run
    model = build_model(
        params.model,
        vocab_size=len(vocab),
        annotation_dim=store.spec.D,
        num_locations=store.spec.L,
        grid_w=store.spec.grid_w,
        attention=attention,
        **semi_sampling_options(cfg),
    )
    if model.config.normalize_features:
        mean, std = channel_statistics(store)
        model.set_feature_statistics(torch.from_numpy(mean), torch.from_numpy(std))
    model.to(device)  # before the optimiser exists, so resumed optimiser state lands on device too
    criterion = build_criterion(attention, cfg)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay)
    return _Setup(
        attention=attention,
        cfg=cfg,
        device=device,
        model_dir=out_dir / attention,
        vocab=vocab,
        train_store=store,
        dataset=dataset,
        skipped=len(skipped),
        sampler=sampler,
        mirror=params.train.mirror,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.lr_schedule, cfg.max_epochs, cfg.lr_decay),
    )


@dataclass(frozen=True)
class _Phase:
    """One stretch of training with its own objective and optimiser (internal): likelihood
    (Eq. 14 / Sec. 4.1), then optionally self-critical epochs (``scst_epochs``)."""

    name: str  # recorded in last_state.pt, so that a resume knows where it stands
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Callable[[int], Any]
    max_epochs: int  # the last epoch of the phase, counted from the run's first
    step_loss: Callable[[nn.Module, nn.Module, Any], Any] | None = None


LIKELIHOOD, SELF_CRITICAL = "likelihood", "self_critical"


def _likelihood_phase(setup: _Setup) -> _Phase:
    return _Phase(
        LIKELIHOOD,
        setup.criterion,
        setup.optimizer,
        setup.scheduler,
        setup.batches,
        setup.cfg.max_epochs,
    )


def _self_critical_phase(params: Params, setup: _Setup) -> _Phase:
    """REINFORCE on CIDEr-D, plus BLEU-4 and BLEU-1 if asked (``sat_model.train.self_critical``),
    with a new optimiser."""
    cfg = setup.cfg
    reward = Reward(references_by_image(setup.dataset), cfg.scst_bleu_weight, cfg.scst_bleu1_weight)
    optimizer = build_optimizer(setup.model.parameters(), cfg.optimizer, cfg.scst_lr)

    def batches(epoch: int) -> ImageBatches:
        return ImageBatches(
            setup.dataset,
            setup.model,
            reward,
            batch_size=cfg.scst_batch_size,
            num_samples=cfg.scst_samples,
            max_length=params.train.val_max_length,
            seed=params.train.seed,
            epoch=epoch,
            rank=setup.sampler.rank,
            num_replicas=setup.sampler.num_replicas,
        )

    return _Phase(
        SELF_CRITICAL,
        SelfCriticalLoss(),
        optimizer,
        build_scheduler(optimizer, cfg.lr_schedule, cfg.scst_epochs, cfg.lr_decay),
        batches,
        cfg.max_epochs + cfg.scst_epochs,
        self_critical_step,
    )


def _fit_options(
    params: Params, setup: _Setup, rank: int, log_every: int, max_epochs: int
) -> FitOptions:
    return FitOptions(
        max_epochs=max_epochs,
        patience=setup.cfg.patience,
        device=setup.device,
        grad_clip=setup.cfg.grad_clip,
        seed=params.train.seed * 1_000 + rank,  # each rank its own dropout stream
        log_every=log_every,
        ema_decay=setup.cfg.ema_decay,
        monitor=params.train.monitor,
        autocast_dtype=torch.bfloat16 if params.train.mixed_precision == "bf16" else None,
    )


def _rank_zero(
    params: Params,
    setup: _Setup,
    prepared_dir: Path,
    features_dir: Path,
    curves: list[dict[str, Any]],
    identity: str | None,
) -> tuple[Callable[[nn.Module], dict[str, float]], _ModelDirWriter]:
    """Rank 0's ``validate(model)`` (first ``train.val_images`` validation images) and the
    callback writing the model folder."""
    val_store = FeatureStore(features_dir / store_file("val"))
    validate = make_validator(
        val_store,
        load_references(prepared_dir / CAPTIONS_FILE, "val"),
        setup.vocab,
        max_images=params.train.val_images,
        max_length=params.train.val_max_length,
        batch_size=params.eval.batch_size,
        device=setup.device,
        mode=decode_mode(params.eval.hard_decode, setup.attention),
    )
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
    }
    if identity is not None:
        extra_config["identity"] = identity
    drift = fit_stores(setup.train_store, val_store)  # how far new photos are (sat caption)
    if drift is not None:
        extra_config["drift"] = drift.to_config()
    writer = _ModelDirWriter(
        setup.model_dir, setup.model, setup.vocab, extra_config, curves, counts
    )
    return validate, writer


def semi_sampling_options(cfg: Any) -> dict[str, Any]:
    """``build_model``'s semi-sampling arguments from a train section: only the hard section
    has the semi-sampling coin (Sec. 4.1)."""
    if hasattr(cfg, "semi_sampling_p"):
        return {"semi_sampling_p": cfg.semi_sampling_p, "semi_sampling_per": cfg.semi_sampling_per}
    return {}


def _resume(directory: Path, setup: _Setup, phases: list[_Phase]) -> tuple[ResumeState, int]:
    """Load the folder's last training state (``last_state.pt``; a folder without one continues
    from its best checkpoint) into the model (the weights the optimiser updates) and the rest of
    the phase it was saved in; returns where to resume and that phase's index in ``phases``.
    A likelihood phase that had ended goes on into the self-critical one, from its best
    weights."""
    last = directory / LAST_STATE_FILE
    # also checks the folder's vocabulary; its training state only when there is no last one
    best = load_checkpoint(directory, vocab=setup.vocab, training=not last.is_file())
    if best.training is None:
        state = load_training_state(last)
    else:
        state = {"model_state": best.model_state, **vars(best.training)}
    names = [p.name for p in phases]
    saved = state.get("phase", LIKELIHOOD)
    if saved not in names:
        raise CheckpointError(
            f"{directory} was saved in the {saved} phase, which this run does not have "
            f"(train.{setup.attention}.scst_epochs is 0)"
        )
    index = names.index(saved)
    ended = state["epoch"] >= phases[index].max_epochs or _stopped(state, setup.cfg.patience)
    average = None
    if ended and index + 1 < len(phases):
        # the next phase starts from the best weights with its own optimiser
        index += 1
        _load_into(directory, setup.model, best.model_state)
    else:
        phase = phases[index]
        train_state = state.get("train_state")
        # with a moving average, model_state is the average of train_state
        _load_into(directory, setup.model, train_state or state["model_state"])
        _load_into(directory, phase.criterion, state.get("criterion_state") or {})
        if state.get("optimizer_state") is not None:
            _load_into(directory, phase.optimizer, state["optimizer_state"])
        if state.get("scheduler_state") is not None:
            _load_into(directory, phase.scheduler, state["scheduler_state"])
        average = state["model_state"] if train_state is not None else None
    _restore_rng(state.get("rng_state"))
    resume = ResumeState(
        epoch=state["epoch"],
        best_score=state.get("best_score"),
        best_epoch=state.get("best_epoch"),
        best_state=best.model_state,
        average_state=average,
    )
    return resume, index


def _stopped(state: Mapping[str, Any], patience: int) -> bool:
    """The saved run had stopped early: ``patience`` epochs without a better score."""
    best_epoch = state.get("best_epoch")
    return best_epoch is not None and state["epoch"] - best_epoch >= patience


def _load_into(directory: Path, target: Any, state: Mapping[str, Any]) -> None:
    """``target.load_state_dict(state)`` (a module, optimiser or scheduler), a mismatch reported
    as :class:`CheckpointError`."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: the state does not fit this run's model: {e}") from e


def _restore_rng(rng: Mapping[str, Any] | None) -> None:
    if not rng:
        return
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _read_metrics(model_dir: Path) -> dict[str, float]:
    path = model_dir / TRAIN_METRICS_FILE
    if not is_checkpoint_dir(model_dir) or not path.is_file():
        return {}
    metrics: dict[str, float] = json.loads(path.read_text(encoding="utf-8"))
    return metrics
