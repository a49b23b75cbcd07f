"""A training run's set-up and phases: what one rank trains (:class:`Setup`, built from the
files before the first epoch), the likelihood phase (Eq. 14 / Sec. 4.1) and the optional
self-critical one, each fitted by :func:`sat_model.train.trainer.fit` in turn."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sat_model.config import LibraryParams
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE
from sat_model.data.vocab import Vocab, load_vocab
from sat_model.evaluation.metrics import metric_direction
from sat_model.features.store import (
    FeatureStore,
    FeatureStoreError,
    channel_statistics,
    store_file,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.factory import build_model
from sat_model.model.losses import SelfCriticalLoss, build_criterion
from sat_model.train.batching import (
    Batch,
    CaptionDataset,
    LengthGroupedBatchSampler,
    load_caption_dataset,
    mirror_draws,
)
from sat_model.train.optim import build_optimizer, build_scheduler
from sat_model.train.self_critical import (
    ImageBatches,
    Reward,
    SamplingPlan,
    references_by_image,
    self_critical_step,
)
from sat_model.train.trainer import (
    Callback,
    FitOptions,
    Objective,
    ResumeState,
    fit,
)

__all__ = [
    "LIKELIHOOD",
    "SELF_CRITICAL",
    "Phase",
    "Setup",
    "fit_options",
    "likelihood_phase",
    "run_phases",
    "self_critical_phase",
    "semi_sampling_options",
    "set_up",
]

LIKELIHOOD, SELF_CRITICAL = "likelihood", "self_critical"


class EpochBatches:
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


@dataclass(frozen=True)
class Setup:
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

    def batches(self, epoch: int) -> EpochBatches:
        mirror = None
        if self.mirror > 0:
            mirror = mirror_draws(len(self.dataset), self.mirror, self.sampler.seed, epoch)
        return EpochBatches(self.dataset, self.sampler.batches(epoch), mirror)


def set_up(
    params: LibraryParams,
    attention: str,
    prepared_dir: Path,
    features_dir: Path,
    out_dir: Path,
    rank: int,
    world_size: int,
    device: torch.device | str | None,
) -> Setup:
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
    return Setup(
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


def semi_sampling_options(cfg: Any) -> dict[str, Any]:
    """``build_model``'s semi-sampling arguments from a train section: only the hard section
    has the semi-sampling coin (Sec. 4.1)."""
    if hasattr(cfg, "semi_sampling_p"):
        return {"semi_sampling_p": cfg.semi_sampling_p, "semi_sampling_per": cfg.semi_sampling_per}
    return {}


@dataclass(frozen=True)
class Phase:
    """One stretch of training with its own objective and optimiser (internal): likelihood
    (Eq. 14 / Sec. 4.1), then optionally self-critical epochs (``scst_epochs``)."""

    name: str  # recorded in last_state.pt, so that a resume knows where it stands
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Callable[[int], Any]
    max_epochs: int  # the last epoch of the phase, counted from the run's first
    step_loss: Callable[[nn.Module, nn.Module, Any], Any] | None = None


def likelihood_phase(setup: Setup) -> Phase:
    return Phase(
        LIKELIHOOD,
        setup.criterion,
        setup.optimizer,
        setup.scheduler,
        setup.batches,
        setup.cfg.max_epochs,
    )


def self_critical_phase(params: LibraryParams, setup: Setup) -> Phase:
    """REINFORCE on CIDEr-D, plus BLEU-4 and BLEU-1 if asked (``sat_model.train.self_critical``),
    with a new optimiser."""
    cfg = setup.cfg
    reward = Reward(references_by_image(setup.dataset), cfg.scst_bleu_weight, cfg.scst_bleu1_weight)
    optimizer = build_optimizer(setup.model.parameters(), cfg.optimizer, cfg.scst_lr)
    plan = SamplingPlan(
        cfg.scst_batch_size, cfg.scst_samples, params.train.val_max_length, params.train.seed
    )

    def batches(epoch: int) -> ImageBatches:
        return ImageBatches(
            setup.dataset,
            setup.model,
            reward,
            plan,
            epoch=epoch,
            rank=setup.sampler.rank,
            num_replicas=setup.sampler.num_replicas,
        )

    return Phase(
        SELF_CRITICAL,
        SelfCriticalLoss(),
        optimizer,
        build_scheduler(optimizer, cfg.lr_schedule, cfg.scst_epochs, cfg.lr_decay),
        batches,
        cfg.max_epochs + cfg.scst_epochs,
        self_critical_step,
    )


def fit_options(
    params: LibraryParams, setup: Setup, rank: int, log_every: int, max_epochs: int
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
        mode=metric_direction(params.train.monitor),
        autocast_dtype=torch.bfloat16 if params.train.mixed_precision == "bf16" else None,
    )


def run_phases(
    setup: Setup,
    phases: Sequence[Phase],
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
            Objective(phase.criterion, phase.optimizer, phase.scheduler, phase.step_loss),
            phase.batches,
            validate,
            options(phase.max_epochs),
            [*writers, *callbacks],
            resume=resume,
            wrap_model=wrap_model,
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
