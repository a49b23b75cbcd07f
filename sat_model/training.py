"""The training loop: teacher forcing, clipping, a per-epoch LR schedule, early stopping.

Nothing here is specific to the captioning model or to Ray (minGPT's trainer rule): the model,
criterion, optimiser, scheduler, the batches of each epoch (already sharded for this rank) and a
validation function come in as arguments; everything else (progress bars, checkpoint files, Ray
reports, MLflow) comes in through :class:`Callback`. Early stopping watches a validation score
(BLEU-4 from free-running greedy decoding, Sec. 5 "early stopping on BLEU"), never teacher-forced
argmax accuracy (docs/METHOD.md, "Known pitfalls").

Per-step work never waits on the device: losses are summed on the device and read back only
every ``log_every`` steps and at the end of the epoch, which is also when a non-finite loss is
noticed (:class:`NonFiniteLossError`, raised before any callback sees the bad epoch, so the last
checkpoint a callback wrote stays the last good one).

With ``ema_decay`` > 0 the loop also keeps an exponential moving average of the weights
(``torch.optim.swa_utils``, updated after every optimiser step); that average is what is
validated, kept as the best state and saved as ``model_state``, while the weights the optimiser
updates travel beside it as ``train_state`` so a resumed run continues both.

Epochs are counted from 1 in everything reported (``EpochState.epoch`` = epochs completed);
``batches(epoch)`` receives the 0-based index. With ``seed`` given, the torch RNG is re-seeded at
the start of every epoch, so a run resumed at epoch k repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from sat_model.checkpoint import state_of

__all__ = [
    "Callback",
    "EpochState",
    "FitResult",
    "NonFiniteLossError",
    "ProgressBar",
    "TrainBatch",
    "build_optimizer",
    "build_scheduler",
    "fit",
]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; training stopped without reporting the epoch."""


class TrainBatch(Protocol):
    """What the loop needs of a batch (``sat_model.batching.Batch`` is one)."""

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
    seconds: float
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


def build_optimizer(
    parameters: Iterable[nn.Parameter], name: str, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """Adam (Flickr30k, COCO) or RMSProp (Flickr8k), as in Sec. 5."""
    params = [p for p in parameters if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adam' or 'rmsprop'")


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, max_epochs: int, lr_decay: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate schedule stepped once per epoch."""
    sched = torch.optim.lr_scheduler
    if schedule == "constant":
        return sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if schedule == "cosine":
        return sched.CosineAnnealingLR(optimizer, T_max=max_epochs)
    if schedule == "step":
        return sched.StepLR(optimizer, step_size=1, gamma=lr_decay)
    raise ValueError(f"unknown lr_schedule {schedule!r}; expected constant, cosine or step")


@dataclass
class _Progress:
    """Mutable early-stopping bookkeeping (internal)."""

    best_score: float | None
    best_epoch: int | None
    best_state: dict[str, torch.Tensor] | None
    history: list[EpochState] = field(default_factory=list)


def fit(
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batches: Callable[[int], Iterable[TrainBatch]],
    validate: Callable[[nn.Module], Mapping[str, float]] | None,
    callbacks: Sequence[Callback] = (),
    *,
    start_epoch: int = 0,
    max_epochs: int,
    patience: int,
    device: torch.device | str = "cpu",
    grad_clip: float | None = None,
    monitor: str = "bleu_4",
    wrap_model: Callable[[nn.Module], nn.Module] | None = None,
    seed: int | None = None,
    log_every: int = 50,
    best_score: float | None = None,
    best_epoch: int | None = None,
    best_state: Mapping[str, torch.Tensor] | None = None,
    ema_decay: float = 0.0,
    average_state: Mapping[str, torch.Tensor] | None = None,
) -> FitResult:
    """Train from epoch ``start_epoch`` (epochs already done) to at most ``max_epochs``.

    Stops after ``patience`` epochs without a better ``validate(model)[monitor]``, and leaves
    ``model`` holding the best weights. ``wrap_model`` (e.g. DDP) wraps the model used for the
    training forward pass; ``validate`` and the saved states use the unwrapped ``model``. When
    ``torch.distributed`` is initialised, rank 0's stop decision is broadcast so every rank
    leaves the loop together. ``best_score``/``best_epoch``/``best_state`` continue a resumed
    run, and ``average_state`` its moving average (the saved ``model_state``; ``model`` then
    holds the saved ``train_state``).
    """
    if patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    model.to(device)
    criterion.to(device)
    train_model = wrap_model(model) if wrap_model is not None else model
    average = _moving_average(model, ema_decay, average_state)
    # what is validated, kept as the best state and saved as model_state
    eval_model = average.module if average is not None else model
    progress = _Progress(best_score, best_epoch, dict(best_state) if best_state else None)
    completed, stopped_early = start_epoch, False
    for epoch in range(start_epoch, max_epochs):
        if seed is not None:
            torch.manual_seed(seed * 100_003 + epoch)
        epoch_batches = batches(epoch)
        total = len(epoch_batches) if isinstance(epoch_batches, Sized) else None
        for cb in callbacks:
            cb.on_epoch_start(epoch, total)
        lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        loss, nll, steps = _train_epoch(
            train_model,
            criterion,
            optimizer,
            epoch_batches,
            device,
            grad_clip,
            epoch,
            log_every,
            callbacks,
            average,
        )
        if scheduler is not None:
            scheduler.step()
        val = dict(validate(eval_model)) if validate is not None else None
        state = _epoch_state(
            eval_model,
            model if average is not None else None,
            criterion,
            optimizer,
            scheduler,
            progress,
            epoch + 1,
            loss,
            nll,
            val,
            lr,
            steps,
            time.perf_counter() - start,
            monitor,
        )
        for cb in callbacks:
            cb.on_epoch_end(state)
        completed = epoch + 1
        if _agree(_should_stop(progress, completed, patience, val is not None), device):
            stopped_early = completed < max_epochs
            break
    best_state = progress.best_state if progress.best_state is not None else state_of(eval_model)
    model.load_state_dict(best_state)
    return FitResult(
        best_score=progress.best_score,
        best_epoch=progress.best_epoch,
        best_state=best_state,
        epochs_completed=completed,
        stopped_early=stopped_early,
        history=progress.history,
    )


def _moving_average(
    model: nn.Module, decay: float, state: Mapping[str, torch.Tensor] | None
) -> AveragedModel | None:
    """The EMA of ``model``'s parameters, or None for ``decay`` 0; ``state`` resumes one."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema_decay must be in [0, 1), got {decay}")
    if decay == 0.0:
        return None
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    if state is not None:
        average.module.load_state_dict(state)
        average.n_averaged.fill_(1)  # continue the average; 0 would restart it from model
    return average


def _train_epoch(
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[TrainBatch],
    device: torch.device | str,
    grad_clip: float | None,
    epoch: int,
    log_every: int,
    callbacks: Sequence[Callback],
    average: AveragedModel | None = None,
) -> tuple[float, float, int]:
    """One pass of teacher forcing; returns mean loss, mean NLL and the number of steps."""
    model.train()
    criterion.train()
    total = torch.zeros(2, device=device)  # (loss, nll) summed on the device: no per-step sync
    window = torch.zeros((), device=device)
    steps = 0
    for steps, batch in enumerate(batches, start=1):
        batch = batch.to(device)
        optimizer.zero_grad(set_to_none=True)
        out = criterion(model(batch.annotations, batch.captions), batch.captions)
        out.loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        if average is not None:
            average.update_parameters(model)
        loss = out.loss.detach()
        total += torch.stack([loss, out.nll.detach().to(loss.dtype)])
        window += loss
        if steps % log_every == 0:
            mean = _checked(window.item() / log_every, epoch, steps)
            window.zero_()
            for cb in callbacks:
                cb.on_log(epoch, steps, mean)
    if steps == 0:
        raise ValueError(f"epoch {epoch}: batches({epoch}) yielded no batch")
    loss_sum, nll_sum = total.tolist()
    return _checked(loss_sum / steps, epoch, steps), nll_sum / steps, steps


def _checked(loss: float, epoch: int, step: int) -> float:
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"training loss is {loss} at epoch {epoch + 1} by step {step}: stopping; the last "
            f"checkpoint written stays the last good one (lower the learning rate or check the "
            f"features for NaN/inf)"
        )
    return loss


def _epoch_state(
    model: nn.Module,
    trained: nn.Module | None,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    progress: _Progress,
    epoch: int,
    loss: float,
    nll: float,
    val: dict[str, float] | None,
    lr: float,
    steps: int,
    seconds: float,
    monitor: str,
) -> EpochState:
    """Update the best score/state and describe the epoch; ``model`` is the one validated,
    ``trained`` the one the optimiser updates when that is another (the moving average's)."""
    if val is not None and monitor not in val:
        raise KeyError(f"validate() returned {sorted(val)}, without the monitored {monitor!r}")
    score = val[monitor] if val is not None else None
    is_best = score is None or progress.best_score is None or score > progress.best_score
    if is_best:
        progress.best_score, progress.best_epoch = score, epoch
        progress.best_state = state_of(model)
    best_score, best_epoch = progress.best_score, progress.best_epoch

    def checkpoint() -> dict[str, Any]:
        return {
            "model_state": state_of(model),
            "train_state": state_of(trained) if trained is not None else None,
            "criterion_state": state_of(criterion),
            "optimizer_state": optimizer.state_dict(),
            "scheduler_state": scheduler.state_dict() if scheduler is not None else None,
            "epoch": epoch,
            "best_score": best_score,
            "best_epoch": best_epoch,
        }

    state = EpochState(
        epoch, loss, nll, val, lr, is_best, best_score, best_epoch, steps, seconds, checkpoint
    )
    progress.history.append(state)
    return state


def _should_stop(progress: _Progress, epoch: int, patience: int, validated: bool) -> bool:
    """``patience`` epochs in a row without a better score (Sec. 5: early stopping on BLEU)."""
    if not validated or progress.best_epoch is None:
        return False
    return epoch - progress.best_epoch >= patience


def _agree(stop: bool, device: torch.device | str) -> bool:
    # only rank 0 validates; every rank must leave the loop on the same epoch (DDP collectives)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return stop
    flag = torch.tensor([int(stop)], device=device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


class ProgressBar(Callback):
    """A tqdm bar per epoch, updated on each ``on_log`` (so it adds no per-step sync)."""

    def __init__(self, desc: str = "train") -> None:
        self.desc = desc
        self._bar: Any = None

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=num_batches, desc=f"{self.desc} epoch {epoch + 1}", unit="batch")

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(loss=f"{loss:.3f}")

    def on_epoch_end(self, state: EpochState) -> None:
        self._bar.update(state.steps - self._bar.n)
        post = {"loss": f"{state.train_loss:.3f}"}
        if state.val_metrics:
            post.update({k: f"{v:.4f}" for k, v in state.val_metrics.items() if k == "bleu_4"})
        self._bar.set_postfix(post)
        self._bar.close()
