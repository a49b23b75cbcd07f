"""A console progress bar for the training loop, as a :class:`~sat_model.train.trainer.Callback`."""

from __future__ import annotations

from typing import Any

from sat_model.train.trainer import Callback, EpochState

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """A tqdm bar per epoch on a terminal (none in a log), moved after every batch; the loss
    shown is the last ``on_log`` mean, so the bar adds no per-step sync."""

    def __init__(self, desc: str = "train") -> None:
        self.desc = desc
        self._bar: Any = None

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=num_batches, desc=f"{self.desc} epoch {epoch + 1}", unit="batch", disable=None
        )

    def on_batch_end(self, epoch: int, step: int, captions: int) -> None:
        self._bar.update(step - self._bar.n)

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.3f}")

    def on_epoch_end(self, state: EpochState) -> None:
        self._bar.update(state.steps - self._bar.n)
        post = {"loss": f"{state.train_loss:.3f}"}
        if state.val_metrics:
            post.update({k: f"{v:.4f}" for k, v in state.val_metrics.items() if k == "bleu_4"})
        self._bar.set_postfix(post)
        self._bar.close()
