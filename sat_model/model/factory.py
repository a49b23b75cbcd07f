"""The model factory: ``params.model`` plus what the data fixes, to a ``ShowAttendTell``."""

from __future__ import annotations

import math

from sat_model.config import ATTENTION_KINDS, ModelParams
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.kernels import build_backend

__all__ = ["build_model"]


def build_model(
    model_params: ModelParams,
    *,
    vocab_size: int,
    annotation_dim: int,
    num_locations: int,
    attention: str,
    semi_sampling_p: float = 0.5,
    semi_sampling_per: str = "image",
    grid_w: int | None = None,
) -> ShowAttendTell:
    """The factory: ``params.model`` plus what the data fixes (K, D, L, the grid) and the variant.

    ``semi_sampling_p``/``semi_sampling_per`` come from ``params.train.hard`` (ignored for soft);
    ``grid_w`` is the feature grid's width, None for a square grid (the encoders' crops are).
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
    config = ModelConfig(
        **model_params.model_dump(exclude={"backend"}),  # the params' sizes and switches, as given
        vocab_size=vocab_size,
        annotation_dim=annotation_dim,
        num_locations=num_locations,
        attention=attention,
        semi_sampling_p=semi_sampling_p,
        semi_sampling_per=semi_sampling_per,
        grid_w=grid_w if grid_w is not None else math.isqrt(num_locations),
    )
    return ShowAttendTell(config, backend=build_backend(model_params.backend))
