"""Resuming a training run from a model folder: its last training state (or its best
checkpoint) into the model, criterion, optimiser and scheduler of the phase it was saved in."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sat_model.model.checkpoint import LAST_STATE_FILE, CheckpointError, load_checkpoint
from sat_model.train.model_dir import load_training_state
from sat_model.train.phases import LIKELIHOOD, Phase, Setup
from sat_model.train.trainer import ResumeState

__all__ = ["resume_run"]


def resume_run(directory: Path, setup: Setup, phases: list[Phase]) -> tuple[ResumeState, int]:
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
