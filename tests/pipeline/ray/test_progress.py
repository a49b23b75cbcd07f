"""The driver's progress line: every rank's report of an epoch summed into one line."""

from __future__ import annotations

import io

import pytest

from pipeline.ray.progress import (
    BatchReport,
    EpochReport,
    ProgressDisplay,
    format_epoch_line,
    remaining_time,
)
from pipeline.stages import format_duration


def _rank(captions: int, train_s: float, epoch_s: float, loss: float, **val: float) -> dict:
    return {
        "epoch": 3,
        "train_loss": loss,
        "captions": captions,
        "train_seconds": train_s,
        "epoch_seconds": epoch_s,
        **val,
    }


def test_throughput_sums_the_ranks_captions_over_the_slowest_ranks_training_time() -> None:
    # rank 0 validates (longer epoch, the only scores); rank 1 trains slower
    report = EpochReport.from_ranks(
        [
            _rank(600, 2.0, 5.0, 3.0, val_bleu_1=0.5, val_bleu_4=0.25, val_cider=0.61),
            _rank(600, 3.0, 3.5, 4.0),
        ]
    )
    assert report.captions == 1200
    assert report.captions_per_s == pytest.approx(400.0)  # 1200 / 3 s
    assert report.loss == pytest.approx(3.5)
    assert report.val == {"bleu_4": 0.25, "cider": 0.61}
    assert report.seconds == 5.0
    line = format_epoch_line("train soft", report, max_epochs=10, eta_s=130)
    assert line == (
        "train soft  epoch 3/10  loss 3.500  val BLEU-4 0.2500  CIDEr 0.6100  400 captions/s"
        "  ETA 2m10s"
    )


def test_an_epoch_without_validation_shows_a_dash() -> None:
    report = EpochReport.from_ranks([_rank(10, 1.0, 1.0, 2.0)])
    assert "val BLEU-4 -  CIDEr -  10 captions/s" in format_epoch_line("train hard", report, 3, 0)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (59.4, "59s"), (60, "1m00s"), (3725, "1h02m")]
)
def test_durations_read_at_the_etas_resolution(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def _epoch(epoch: int, seconds: float) -> EpochReport:
    return EpochReport(epoch, 1.0, {}, 100, seconds, seconds)


def test_the_eta_counts_the_self_critical_epochs_until_one_is_timed() -> None:
    # the Flickr8k profile: 5 likelihood epochs (~100 s here), then 10 self-critical (~200 s)
    likelihood = [_epoch(e, 100.0) for e in (1, 2, 3)]
    assert remaining_time(likelihood, 15, likelihood_epochs=5) == (200.0, 10)
    line = format_epoch_line("train soft", likelihood[-1], 15, 200.0, 10)
    assert line.endswith("ETA 3m20s + 10 self-critical epochs")
    at_the_boundary = [*likelihood, _epoch(4, 100.0), _epoch(5, 100.0)]
    assert remaining_time(at_the_boundary, 15, likelihood_epochs=5) == (0.0, 10)
    assert format_epoch_line("t", at_the_boundary[-1], 15, 0.0, 10).endswith(
        "ETA 10 self-critical epochs"
    )
    # once one is timed, the rest go at the self-critical mean, not the whole run's
    critical = [*at_the_boundary, _epoch(6, 190.0), _epoch(7, 210.0)]
    assert remaining_time(critical, 15, likelihood_epochs=5) == (8 * 200.0, 0)


def test_without_self_critical_epochs_the_eta_is_the_mean_epoch_times_the_epochs_left() -> None:
    reports = [_epoch(1, 90.0), _epoch(2, 110.0)]
    assert remaining_time(reports, 10) == (800.0, 0)
    assert remaining_time(reports, 10, likelihood_epochs=10) == (800.0, 0)
    assert format_epoch_line("t", reports[-1], 10, 800.0).endswith("ETA 13m20s")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _feed(display: ProgressDisplay, batches: int) -> None:
    """One epoch of 40 batches as rank 0 reports it (every batch: 20ths of 40), then its line."""
    for step in range(1, batches + 1):
        display.batch(
            BatchReport(2, step, batches, captions=step * 64, seconds=step * 0.5, world_size=2)
        )
    display.epoch(2, "train soft  epoch 2/10  loss 3.000  (the epoch's line)")


def test_in_a_log_an_epoch_shows_a_line_at_each_quarter_then_its_own_line() -> None:
    log = io.StringIO()
    _feed(ProgressDisplay("train soft", 10, log), 40)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()  # plain lines, no bar redrawn in place
    # 64 captions a batch on each of 2 ranks, a batch every 0.5 s: 256 captions/s
    assert lines == [
        "train soft  epoch 2/10  batch 10/40  256 captions/s  epoch ETA 15s",
        "train soft  epoch 2/10  batch 20/40  256 captions/s  epoch ETA 10s",
        "train soft  epoch 2/10  batch 30/40  256 captions/s  epoch ETA 5s",
        "train soft  epoch 2/10  loss 3.000  (the epoch's line)",
    ]


def test_on_a_terminal_an_epoch_is_a_bar_then_its_own_line() -> None:
    terminal = _Terminal()
    _feed(ProgressDisplay("train soft", 10, terminal), 40)
    shown = terminal.getvalue()
    assert "\r" in shown and "40/40" in shown and "256 captions/s" in shown  # tqdm's bar
    assert "batch 10/40" not in shown  # no log lines
    assert shown.endswith("train soft  epoch 2/10  loss 3.000  (the epoch's line)\n")


def test_the_next_epochs_progress_waits_for_the_line_of_the_epoch_before() -> None:
    """Rank 0 starts epoch 3 before epoch 2's line comes through the controller: epoch 3's
    progress is shown after it, from its newest report."""
    log = io.StringIO()
    display = ProgressDisplay("train soft", 10, log)
    for epoch, step in ((2, 10), (3, 10), (3, 20)):
        display.batch(BatchReport(epoch, step, 40, step * 64, step * 0.5, world_size=2))
    display.epoch(2, "train soft  epoch 2/10  loss 3.000")
    assert log.getvalue().splitlines() == [
        "train soft  epoch 2/10  batch 10/40  256 captions/s  epoch ETA 15s",
        "train soft  epoch 2/10  loss 3.000",
        "train soft  epoch 3/10  batch 20/40  256 captions/s  epoch ETA 10s",
    ]
