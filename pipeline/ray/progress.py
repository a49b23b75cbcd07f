"""Progress on the driver: one line per Ray Train epoch, one table row per Tune trial result.

Ray Train's callbacks run on a controller actor whose output never reaches the driver
(``log_to_driver`` is off: every worker's output would flood it), so :func:`epoch_progress`
gives Ray Train a ``UserCallback`` that puts each epoch's reports, all ranks' at once, on a
``ray.util.queue.Queue``, and rank 0 puts its place within the epoch (:class:`BatchReport`) on
the same queue. A driver thread prints them: a tqdm bar on a terminal, a line each quarter epoch
in a log, and one line per epoch::

    train soft  epoch 3/10  loss 3.412  val BLEU-4 0.1234  CIDEr 0.4567  612 captions/s  ETA 2m10s

Throughput is the captions of every rank over the slowest rank's training seconds; the ETA
counts each phase (likelihood, self-critical) by its own mean epoch time. :func:`trial_table` is
the Tune counterpart: a row per trial result and one when a trial ends.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from pipeline.ray import runtime  # noqa: F401  (loopback env before ray is imported)
from pipeline.stages import format_duration
from sat_model.evaluation.metrics import metric_keys, metric_label, metric_of_key
from sat_model.train.model_dir import CURVE_KEYS
from sat_model.train.trainer import Callback

__all__ = [
    "BatchReport",
    "BatchSender",
    "EpochProgress",
    "EpochReport",
    "ProgressDisplay",
    "epoch_progress",
    "format_batch_line",
    "format_epoch_line",
    "remaining_time",
    "trial_table",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochReport:
    """One epoch of a Ray Train run, from every rank's ``ray.train.report`` metrics."""

    epoch: int
    loss: float  # mean over ranks of each rank's mean training loss
    # validation scores by key (rank 0 validates): BLEU-4 and CIDEr always, None when no rank
    # reported them, and any other score reported (train.monitor's)
    val: Mapping[str, float | None]
    captions: int  # trained on, summed over ranks
    train_seconds: float  # the slowest rank's training pass
    seconds: float  # the slowest rank's epoch: training and validation

    @property
    def captions_per_s(self) -> float:
        return self.captions / self.train_seconds if self.train_seconds > 0 else 0.0

    @classmethod
    def from_ranks(cls, metrics: Sequence[Mapping[str, Any]]) -> EpochReport:
        """From ``metrics[rank]``, each with ``epoch``, ``train_loss``, ``captions``,
        ``train_seconds``, ``epoch_seconds`` (what ``pipeline.ray.train`` reports)."""
        return cls(
            epoch=int(metrics[0]["epoch"]),
            loss=sum(float(m["train_loss"]) for m in metrics) / len(metrics),
            val={k: _reported(metrics, f"val_{k}") for k in _validation_keys(metrics)},
            captions=sum(int(m["captions"]) for m in metrics),
            train_seconds=max(float(m["train_seconds"]) for m in metrics),
            seconds=max(float(m["epoch_seconds"]) for m in metrics),
        )


def _validation_keys(metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    """BLEU-4 and CIDEr, then the reported ``val_<key>`` of any other metric family (the one
    ``train.monitor`` names), in report order."""
    shown = {metric_of_key(k) for k in CURVE_KEYS}
    reported = [k.removeprefix("val_") for m in metrics for k in m if k.startswith("val_")]
    others = [k for k in reported if k in metric_keys() and metric_of_key(k) not in shown]
    return list(dict.fromkeys([*CURVE_KEYS, *others]))


def _reported(metrics: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The first rank's value of ``key`` (only rank 0 validates), None when no rank has it."""
    values = [m[key] for m in metrics if m.get(key) is not None]
    return float(values[0]) if values else None


def remaining_time(
    reports: Sequence[EpochReport], max_epochs: int, likelihood_epochs: int | None = None
) -> tuple[float, int]:
    """(seconds, untimed): the epochs after the last report, each at its phase's mean epoch
    time so far, and the self-critical epochs left when none has been timed yet. Epochs after
    ``likelihood_epochs`` (default: all of them are likelihood epochs) are self-critical."""
    boundary = max_epochs if likelihood_epochs is None else likelihood_epochs
    last = reports[-1].epoch
    seconds, untimed = 0.0, 0
    for first, end in ((1, boundary), (boundary + 1, max_epochs)):
        left = max(end - max(last, first - 1), 0)
        timed = [r.seconds for r in reports if first <= r.epoch <= end]
        if timed:
            seconds += left * sum(timed) / len(timed)
        else:  # a phase with no report so far is all ahead: the self-critical one
            untimed = left
    return seconds, untimed


def format_epoch_line(
    label: str, report: EpochReport, max_epochs: int, eta_s: float, untimed: int = 0
) -> str:
    """The line of one epoch; ``untimed``: self-critical epochs left that ``eta_s`` lacks."""
    scores = "  ".join(
        f"{metric_label(k)} {'-' if v is None else f'{v:.4f}'}" for k, v in report.val.items()
    )
    eta = [format_duration(eta_s)] if eta_s > 0 or not untimed else []
    if untimed:
        eta.append(f"{untimed} self-critical epoch{'s' if untimed > 1 else ''}")
    return (
        f"{label}  epoch {report.epoch}/{max_epochs}  loss {report.loss:.3f}  val {scores}"
        f"  {report.captions_per_s:.0f} captions/s  ETA {' + '.join(eta)}"
    )


@dataclass(frozen=True)
class BatchReport:
    """Where rank 0 is within an epoch (what :class:`BatchSender` puts in the queue)."""

    epoch: int  # from 1
    step: int  # batches done in this epoch
    batches: int | None  # this epoch's batches on the rank, when the loader knows
    captions: int  # captions rank 0 trained on so far in this epoch
    seconds: float  # since the epoch's first batch began
    world_size: int

    @property
    def captions_per_s(self) -> float:
        """All ranks' rate, as rank 0's times the ranks: the shards are equal in size."""
        return self.captions * self.world_size / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """The epoch's training time left at this pace (validation not included)."""
        if not self.batches or not self.step:
            return None
        return self.seconds / self.step * (self.batches - self.step)


def format_batch_line(label: str, report: BatchReport, max_epochs: int) -> str:
    """The log line of a point within an epoch."""
    of = f"/{report.batches}" if report.batches else ""
    eta = "" if report.eta_s is None else f"  epoch ETA {format_duration(report.eta_s)}"
    return (
        f"{label}  epoch {report.epoch}/{max_epochs}  batch {report.step}{of}"
        f"  {report.captions_per_s:.0f} captions/s{eta}"
    )


class BatchSender(Callback):
    """A ``sat_model.train.trainer`` callback for rank 0: puts a :class:`BatchReport` in the
    driver's queue at every twentieth of the epoch and at least every ``heartbeat_s`` seconds
    (a few dozen small messages an epoch, whatever its length)."""

    def __init__(self, queue: Any, world_size: int, heartbeat_s: float = 10.0) -> None:
        self.queue, self.world_size, self.heartbeat_s = queue, world_size, heartbeat_s
        self._batches: int | None = None
        self._started = self._sent_at = 0.0
        self._sent_part = -1

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        self._batches, self._sent_part = num_batches, -1
        self._started = self._sent_at = time.perf_counter()

    def on_batch_end(self, epoch: int, step: int, captions: int) -> None:
        now = time.perf_counter()
        part = step * 20 // self._batches if self._batches else -1
        if part == self._sent_part and now - self._sent_at < self.heartbeat_s:
            return
        self._sent_part, self._sent_at = part, now
        seconds = now - self._started
        report = BatchReport(epoch + 1, step, self._batches, captions, seconds, self.world_size)
        _put(self.queue, report)


def _put(queue: Any, item: Any) -> None:
    """Put ``item`` in the driver's queue; a driver gone must not fail the training."""
    from ray.exceptions import RayActorError

    try:
        queue.put(item)
    except RayActorError:
        _log.warning("progress queue lost: %s not shown", item)


def _queueing_callback(queue: Any) -> Any:
    """A Ray Train ``UserCallback`` (it runs on the controller) putting every rank's metrics of
    each epoch into ``queue``, as Tune's own ``TuneReportCallback`` forwards its metrics."""
    from ray.exceptions import RayActorError
    from ray.train import UserCallback

    class QueueingCallback(UserCallback):
        def after_report(
            self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
        ) -> None:
            try:
                queue.put(list(metrics))
            except RayActorError:  # the driver is gone: a lost line must not fail the run
                _log.warning("progress queue lost: epoch %s not shown", metrics[0].get("epoch"))

    return QueueingCallback()


@dataclass
class EpochProgress:
    """What :func:`epoch_progress` yields: the callback for ``fit_on_ray``, the queue rank 0's
    :class:`BatchSender` writes to and, on the driver, every epoch's report so far (restarted
    epochs included, in the order they came)."""

    callback: Any  # a ray.train.UserCallback
    queue: Any  # a ray.util.queue.Queue: hand it to rank 0's BatchSender
    reports: list[EpochReport] = field(default_factory=list)


class ProgressDisplay:
    """What the driver shows: within an epoch a tqdm bar on a terminal, or a plain line at each
    quarter and at least every ``every_s`` seconds in a log; each epoch's line either way.

    Rank 0 reports the next epoch's batches straight away, while an epoch's own line comes
    through Ray Train's controller, later: the next epoch's progress waits (the newest report
    kept) until the line of the epoch before it is shown.
    """

    def __init__(self, label: str, max_epochs: int, out: TextIO, every_s: float = 60.0) -> None:
        self.label, self.max_epochs, self.out, self.every_s = label, max_epochs, out, every_s
        self.terminal = out.isatty()
        self._bar: Any = None
        self._epoch, self._quarter, self._printed_at = 0, 0, 0.0
        self._shown = 0  # the last epoch whose own line is shown
        self._held: BatchReport | None = None

    def batch(self, report: BatchReport) -> None:
        if report.epoch > self._epoch > self._shown:  # the epoch before has no line yet
            self._held = report
            return
        if report.epoch != self._epoch:
            self._close()
            self._epoch, self._quarter, self._printed_at = report.epoch, 0, time.monotonic()
        if self.terminal:
            self._move_bar(report)
            return
        quarter = report.step * 4 // report.batches if report.batches else 0
        now = time.monotonic()
        due = 0 < quarter < 4 and quarter > self._quarter  # the epoch's own line is the 4th
        if due or now - self._printed_at >= self.every_s:
            self._quarter, self._printed_at = max(quarter, self._quarter), now
            self._print(format_batch_line(self.label, report, self.max_epochs))

    def _move_bar(self, report: BatchReport) -> None:
        from tqdm import tqdm

        if self._bar is None:
            desc = f"{self.label}  epoch {report.epoch}/{self.max_epochs}"
            self._bar = tqdm(total=report.batches, desc=desc, unit="batch", file=self.out)
        self._bar.update(report.step - self._bar.n)
        self._bar.set_postfix_str(f"{report.captions_per_s:.0f} captions/s", refresh=False)

    def epoch(self, number: int, line: str) -> None:
        """Epoch ``number``'s own line, then the next epoch's progress that waited for it."""
        self._close()
        self._print(line)
        self._shown = max(self._shown, number)
        held, self._held = self._held, None
        if held is not None:
            self.batch(held)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)


@contextlib.contextmanager
def epoch_progress(
    label: str,
    max_epochs: int,
    *,
    likelihood_epochs: int | None = None,
    out: TextIO | None = None,
) -> Iterator[EpochProgress]:
    """Show the Ray Train run(s) fitted in the block with ``callbacks=[progress.callback]``
    (one line per epoch) and a :class:`BatchSender` on ``progress.queue`` (progress within an
    epoch); Ray must be initialised. ``likelihood_epochs``: where the self-critical epochs
    begin (:func:`remaining_time`). ``out``: default stderr."""
    import ray
    from ray.exceptions import RayActorError
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the workers hold every CPU, the queue passes a dict per epoch. On the driver's
    # node, as Ray Train's controller is: on another node, its loss would fail the run
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
    progress = EpochProgress(_queueing_callback(queue), queue)
    display = ProgressDisplay(label, max_epochs, out or sys.stderr)

    def pump() -> None:
        with contextlib.suppress(RayActorError):
            _pump()

    def _pump() -> None:
        while (item := queue.get()) is not None:
            if isinstance(item, BatchReport):
                display.batch(item)
                continue
            report = EpochReport.from_ranks(item)
            progress.reports.append(report)
            eta, untimed = remaining_time(progress.reports, max_epochs, likelihood_epochs)
            display.epoch(report.epoch, format_epoch_line(label, report, max_epochs, eta, untimed))

    thread = threading.Thread(target=pump, name="sat-epoch-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        with contextlib.suppress(RayActorError):  # gone with its node: nothing left to print
            queue.put(None)  # after the controller's last report: the pump prints it, stops
            thread.join(timeout=30)
        queue.shutdown()


def trial_table(columns: Sequence[str], metric: str, out: TextIO | None = None) -> Any:
    """A Tune callback (on the driver) printing one aligned row per trial result and per trial
    end: trial, status, epoch, the searched values ``columns`` (dotted keys), ``metric``."""
    from ray.tune import Callback

    class TrialTable(Callback):
        """Tune callback on the driver: one aligned row per trial result and per trial end."""

        def __init__(self, columns: Sequence[str], metric: str, out: TextIO | None = None) -> None:
            self.columns, self.metric, self.out = list(columns), metric, out
            self.widths = [max(len(_short(c)), 10) for c in self.columns]
            self.header_done = False

        def _row(self, trial: Any, status: str, result: Mapping[str, Any]) -> None:
            widths = [8, 8, 5, *self.widths, 10]
            if not self.header_done:
                self._print(
                    ["trial", "status", "epoch", *map(_short, self.columns), self.metric], widths
                )
                self.header_done = True
            values = [f"{trial.config[c]:.4g}" if c in trial.config else "-" for c in self.columns]
            score = result.get(self.metric)
            cells = [
                str(trial.trial_id)[-8:],
                status,
                str(result.get("epoch", "-")),
                *values,
                "-" if score is None else f"{float(score):.4f}",
            ]
            self._print(cells, widths)

        def _print(self, cells: Sequence[str], widths: Sequence[int]) -> None:
            line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
            print(line, file=self.out or sys.stdout, flush=True)

        def on_trial_result(
            self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
        ) -> None:
            self._row(trial, "running", result)

        def on_trial_complete(
            self, iteration: int, trials: list[Any], trial: Any, **info: Any
        ) -> None:
            self._row(trial, "done", trial.last_result or {})

        def on_trial_error(
            self, iteration: int, trials: list[Any], trial: Any, **info: Any
        ) -> None:
            self._row(trial, "error", trial.last_result or {})

    return TrialTable(columns, metric, out)


def _short(dotted: str) -> str:
    """``train.soft.lr`` -> ``lr``: the column heading of a searched value."""
    return dotted.rsplit(".", 1)[-1]
