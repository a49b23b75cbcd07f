"""The training loop: teacher forcing, clipping, a per-epoch LR schedule, early stopping.

Nothing here is specific to the captioning model or to Ray (minGPT's trainer rule): model,
criterion, optimiser, scheduler, each epoch's batches (already sharded for this rank) and a
validation function come in as arguments; progress, checkpoint files, Ray reports and MLflow
come in through :class:`Callback`. Early stopping watches a validation score from free-running
greedy decoding (Sec. 5), never teacher-forced accuracy (docs/METHOD.md, "Known pitfalls").

Per-step work never waits on the device: losses are read back every ``log_every`` steps and at
the epoch's end, where a non-finite loss raises :class:`NonFiniteLossError` before any callback
sees the epoch. With ``ema_decay`` > 0 a moving average of the weights is what is validated and
saved, the optimiser's weights travelling beside it as ``train_state``. Epochs count from 1 in
everything reported; with ``seed`` the RNG is re-seeded every epoch, so a resumed run repeats
the uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from sat_model.model.checkpoint import state_of

# the optimisers live in sat_model.train.optim; named here too, as callers of fit (and the
# benchmarks that time older trees beside this one) have always found them
from sat_model.train.optim import build_optimizer, build_scheduler

__all__ = [
    "Callback",
    "EpochState",
    "FitOptions",
    "FitResult",
    "NonFiniteLossError",
    "Objective",
    "ResumeState",
    "TrainBatch",
    "build_optimizer",
    "build_scheduler",
    "fit",
]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; training stopped without reporting the epoch."""


class TrainBatch(Protocol):
    """What the loop needs of a batch (``sat_model.train.batching.Batch`` is one)."""

    # read-only (properties), so that a frozen dataclass such as Batch satisfies the protocol
    @property
    def annotations(self) -> torch.Tensor: ...  # (B, L, D)

    @property
    def captions(self) -> torch.Tensor: ...  # (B, T+1)

    def to(self, device: torch.device | str) -> TrainBatch: ...


@dataclass(frozen=True)
class EpochState:
    """What callbacks see at the end of an epoch."""

    epoch: int  # epochs completed, from 1
    train_loss: float  # mean of the criterion's loss over this rank's steps
    train_nll: float  # mean per-token NLL over this rank's steps
    val_metrics: dict[str, float] | None  # None where no validation ran (ranks > 0)
    lr: float  # learning rate used during this epoch
    is_best: bool  # this epoch's score is the best so far (always True without validation)
    best_score: float | None
    best_epoch: int | None
    steps: int
    seconds: float  # the epoch's wall time: training and validation
    captions: int  # captions this rank trained on: its throughput is captions / train_seconds
    train_seconds: float  # the training pass alone
    # builds {model_state, train_state, criterion_state, optimizer_state, scheduler_state, epoch,
    # best_score, best_epoch} as they are now (model_state: the weights validated, the moving
    # average when there is one; train_state: the optimiser's weights then, else None); called
    # only by callbacks that save it
    checkpoint: Callable[[], dict[str, Any]] = field(repr=False)


class Callback:
    """Hooks with no-op defaults; subclass and override what you need."""

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        """``epoch`` is the 0-based index of the epoch about to run."""

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        """Every ``log_every`` steps: the mean loss over those steps (the only per-step sync)."""

    def on_batch_end(self, epoch: int, step: int, captions: int) -> None:
        """After every optimiser step: this epoch's steps and captions so far on this rank,
        counted on the host (no device sync), for progress within an epoch."""

    def on_epoch_end(self, state: EpochState) -> None:
        """After validation; ``state.checkpoint()`` gives the state dicts to save."""


@dataclass(frozen=True)
class FitResult:
    best_score: float | None
    best_epoch: int | None
    best_state: dict[str, torch.Tensor]  # CPU copy of the best model's state_dict
    epochs_completed: int
    stopped_early: bool
    history: list[EpochState]


@dataclass(frozen=True)
class Objective:
    """What one :func:`fit` minimises and how: the criterion, the optimiser and its per-epoch
    schedule; ``step_loss(model, criterion, batch)``, when given, replaces each step's
    ``criterion(model(batch.annotations, batch.captions), batch.captions)`` (self-critical
    batches carry their advantages)."""

    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step_loss: Callable[[nn.Module, nn.Module, Any], Any] | None = None


@dataclass(frozen=True)
class FitOptions:
    """How :func:`fit` trains: the stopping rule, the device and the per-step knobs."""

    max_epochs: int  # the last epoch (counted from 1) that may run
    patience: int  # epochs without a better score before stopping (Sec. 5)
    device: torch.device | str = "cpu"
    grad_clip: float | None = None  # max gradient norm; None: no clipping
    monitor: str = "bleu_4"  # the validation key early stopping watches
    mode: str = "max"  # "max": a higher monitored score is better; "min": a lower one
    seed: int | None = None  # re-seeds torch at each epoch's start, so a resume repeats a run
    log_every: int = 50  # steps between ``on_log`` calls (the only per-step sync)
    ema_decay: float = 0.0  # 0: no moving average of the weights
    # e.g. torch.bfloat16: the training forward pass and loss run under torch.autocast
    # (validation stays in float32); None: no autocast
    autocast_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")


@dataclass(frozen=True)
class ResumeState:
    """Where a resumed run continues from; the default is a fresh run."""

    epoch: int = 0  # epochs already done
    best_score: float | None = None
    best_epoch: int | None = None
    best_state: Mapping[str, torch.Tensor] | None = None  # the best epoch's weights
    # the moving average (saved as model_state; the model then holds the saved train_state)
    average_state: Mapping[str, torch.Tensor] | None = None


@dataclass
class _Progress:
    """Mutable early-stopping bookkeeping (internal)."""

    best_score: float | None
    best_epoch: int | None
    best_state: dict[str, torch.Tensor] | None
    history: list[EpochState] = field(default_factory=list)


@dataclass(frozen=True)
class _Loop:
    """What every epoch of one :func:`fit` call works on (internal)."""

    model: nn.Module  # the unwrapped model the optimiser updates
    train_model: nn.Module  # ``model`` as wrapped for the forward pass (e.g. DDP)
    eval_model: nn.Module  # what is validated and saved as model_state: the average, if any
    average: AveragedModel | None
    objective: Objective
    callbacks: Sequence[Callback]
    options: FitOptions


@dataclass(frozen=True)
class _EpochTotals:
    """One epoch's training figures, before validation (internal)."""

    epoch: int  # completed, from 1
    loss: float
    nll: float
    steps: int
    captions: int
    lr: float
    started: float  # time.perf_counter() at the epoch's start
    train_seconds: float


def fit(
    model: nn.Module,
    objective: Objective,
    batches: Callable[[int], Iterable[TrainBatch]],
    validate: Callable[[nn.Module], Mapping[str, float]] | None,
    options: FitOptions,
    callbacks: Sequence[Callback] = (),
    *,
    resume: ResumeState = ResumeState(),
    wrap_model: Callable[[nn.Module], nn.Module] | None = None,
) -> FitResult:
    """Train from epoch ``resume.epoch`` (epochs already done) to at most ``options.max_epochs``.

    Stops after ``options.patience`` epochs without a better ``validate(model)[monitor]``, and
    leaves ``model`` holding the best weights. ``wrap_model`` (e.g. DDP) wraps the model used for
    the training forward pass; ``validate`` and the saved states use the unwrapped ``model``.
    When ``torch.distributed`` is initialised, rank 0's stop decision is broadcast so every rank
    leaves the loop together. ``resume`` continues a run from its best score, state and moving
    average (``model`` then holds the saved ``train_state``).
    """
    loop = _start(model, objective, callbacks, options, resume, wrap_model)
    resumed_best = dict(resume.best_state) if resume.best_state else None
    progress = _Progress(resume.best_score, resume.best_epoch, resumed_best)
    completed, stopped_early = resume.epoch, False
    for epoch in range(resume.epoch, options.max_epochs):
        totals = _run_epoch(loop, batches, epoch)
        val = dict(validate(loop.eval_model)) if validate is not None else None
        state = _epoch_state(loop, progress, totals, val)
        for cb in callbacks:
            cb.on_epoch_end(state)
        completed = epoch + 1
        if _agree(_should_stop(progress, completed, options.patience, val is not None), loop):
            stopped_early = completed < options.max_epochs
            break
    best = progress.best_state if progress.best_state is not None else state_of(loop.eval_model)
    model.load_state_dict(best)
    return FitResult(
        best_score=progress.best_score,
        best_epoch=progress.best_epoch,
        best_state=best,
        epochs_completed=completed,
        stopped_early=stopped_early,
        history=progress.history,
    )


def _start(
    model: nn.Module,
    objective: Objective,
    callbacks: Sequence[Callback],
    options: FitOptions,
    resume: ResumeState,
    wrap_model: Callable[[nn.Module], nn.Module] | None,
) -> _Loop:
    """Move to the device, wrap, and set up the moving average."""
    model.to(options.device)
    objective.criterion.to(options.device)
    average = _moving_average(model, options.ema_decay, resume.average_state)
    return _Loop(
        model=model,
        train_model=wrap_model(model) if wrap_model is not None else model,
        eval_model=average.module if average is not None else model,
        average=average,
        objective=objective,
        callbacks=callbacks,
        options=options,
    )


def _run_epoch(
    loop: _Loop, batches: Callable[[int], Iterable[TrainBatch]], epoch: int
) -> _EpochTotals:
    """Seed, announce, train one epoch (0-based ``epoch``) and step the schedule."""
    if loop.options.seed is not None:
        torch.manual_seed(loop.options.seed * 100_003 + epoch)
    epoch_batches = batches(epoch)
    total = len(epoch_batches) if isinstance(epoch_batches, Sized) else None
    for cb in loop.callbacks:
        cb.on_epoch_start(epoch, total)
    lr = loop.objective.optimizer.param_groups[0]["lr"]
    start = time.perf_counter()
    work = _train_epoch(loop, epoch_batches, epoch)
    if loop.objective.scheduler is not None:
        loop.objective.scheduler.step()
    return _EpochTotals(
        epoch=epoch + 1,
        loss=work.loss,
        nll=work.nll,
        steps=work.steps,
        captions=work.captions,
        lr=lr,
        started=start,
        train_seconds=time.perf_counter() - start,
    )


def _moving_average(
    model: nn.Module, decay: float, state: Mapping[str, torch.Tensor] | None
) -> AveragedModel | None:
    """The EMA of ``model``'s parameters, or None for ``decay`` 0; ``state`` resumes one."""
    if decay == 0.0:
        return None
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    if state is not None:
        average.module.load_state_dict(state)
        average.n_averaged.fill_(1)  # continue the average; 0 would restart it from model
    return average


@dataclass(frozen=True)
class _EpochWork:
    """What one training pass did on this rank."""

    loss: float  # mean over the steps
    nll: float  # mean per-token NLL over the steps
    steps: int
    captions: int


def _train_epoch(loop: _Loop, batches: Iterable[TrainBatch], epoch: int) -> _EpochWork:
    """One pass of teacher forcing."""
    model, opts, objective = loop.train_model, loop.options, loop.objective
    model.train()
    objective.criterion.train()
    total = torch.zeros(2, device=opts.device)  # (loss, nll) summed on the device: no sync
    window = torch.zeros((), device=opts.device)
    device_type = torch.device(opts.device).type
    autocast = opts.autocast_dtype is not None
    steps = captions = 0
    for steps, batch in enumerate(batches, start=1):
        batch = batch.to(opts.device)
        captions += batch.captions.size(0)  # (B, T+1)
        objective.optimizer.zero_grad(set_to_none=True)
        # bf16 needs no loss scaling (float32's exponent range); backward runs outside autocast
        with torch.autocast(device_type, opts.autocast_dtype or torch.bfloat16, autocast):
            if objective.step_loss is not None:
                out = objective.step_loss(model, objective.criterion, batch)
            else:
                out = objective.criterion(model(batch.annotations, batch.captions), batch.captions)
        out.loss.backward()
        if opts.grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        objective.optimizer.step()
        if loop.average is not None:
            loop.average.update_parameters(model)
        loss = out.loss.detach()
        total += torch.stack([loss, out.nll.detach().to(loss.dtype)])
        window += loss
        for cb in loop.callbacks:
            cb.on_batch_end(epoch, steps, captions)
        if steps % opts.log_every == 0:
            mean = _checked(window.item() / opts.log_every, epoch, steps)
            window.zero_()
            for cb in loop.callbacks:
                cb.on_log(epoch, steps, mean)
    if steps == 0:
        raise ValueError(f"epoch {epoch}: batches({epoch}) yielded no batch")
    loss_sum, nll_sum = total.tolist()
    return _EpochWork(_checked(loss_sum / steps, epoch, steps), nll_sum / steps, steps, captions)


def _checked(loss: float, epoch: int, step: int) -> float:
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss is {loss} at epoch {epoch + 1} by step {step}: stopping; the last "
            f"checkpoint written stays the last good one (lower the learning rate or check the "
            f"features for NaN/inf)"
        )
    return loss


def _epoch_state(
    loop: _Loop, progress: _Progress, totals: _EpochTotals, val: dict[str, float] | None
) -> EpochState:
    """Update the best score/state and describe the epoch."""
    monitor = loop.options.monitor
    if val is not None and monitor not in val:
        raise KeyError(f"validate() returned {sorted(val)}, without the monitored {monitor!r}")
    score = val[monitor] if val is not None else None
    better = (
        score is not None
        and progress.best_score is not None
        and (
            score > progress.best_score
            if loop.options.mode == "max"
            else score < progress.best_score
        )
    )
    is_best = score is None or progress.best_score is None or better
    if is_best:
        progress.best_score, progress.best_epoch = score, totals.epoch
        progress.best_state = state_of(loop.eval_model)
    state = EpochState(
        epoch=totals.epoch,
        train_loss=totals.loss,
        train_nll=totals.nll,
        val_metrics=val,
        lr=totals.lr,
        is_best=is_best,
        best_score=progress.best_score,
        best_epoch=progress.best_epoch,
        steps=totals.steps,
        seconds=time.perf_counter() - totals.started,
        captions=totals.captions,
        train_seconds=totals.train_seconds,
        checkpoint=functools.partial(
            _snapshot, loop, totals.epoch, progress.best_score, progress.best_epoch
        ),
    )
    progress.history.append(state)
    return state


def _snapshot(
    loop: _Loop, epoch: int, best_score: float | None, best_epoch: int | None
) -> dict[str, Any]:
    """The state dicts as they are now (``EpochState.checkpoint``)."""
    trained = loop.model if loop.average is not None else None
    scheduler = loop.objective.scheduler
    return {
        "model_state": state_of(loop.eval_model),
        "train_state": state_of(trained) if trained is not None else None,
        "criterion_state": state_of(loop.objective.criterion),
        "optimizer_state": loop.objective.optimizer.state_dict(),
        "scheduler_state": scheduler.state_dict() if scheduler is not None else None,
        "epoch": epoch,
        "best_score": best_score,
        "best_epoch": best_epoch,
    }


def _should_stop(progress: _Progress, epoch: int, patience: int, validated: bool) -> bool:
    """``patience`` epochs in a row without a better score (Sec. 5: early stopping on BLEU)."""
    if not validated or progress.best_epoch is None:
        return False
    return epoch - progress.best_epoch >= patience


def _agree(stop: bool, loop: _Loop) -> bool:
    # only rank 0 validates; every rank must leave the loop on the same epoch (DDP collectives)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return stop
    flag = torch.tensor([int(stop)], device=loop.options.device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())
