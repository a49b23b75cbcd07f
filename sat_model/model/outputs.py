"""What the decoder returns (``decoder.py``): small frozen records, one per kind of result.

Dimensions as in docs/METHOD.md: ``B`` batch, ``T`` steps, ``L`` locations, ``D`` annotation size,
``n`` LSTM size, ``A`` attention-MLP size, ``K`` vocabulary size, ``k`` rows (beams) per image.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

__all__ = ["AttentionOutput", "DecoderState", "ForwardOutput", "StepOutput"]


@dataclass(frozen=True)
class AttentionOutput:
    alpha: Tensor  # (B, L), Eq. 5
    context: Tensor  # (B, D), φ before the gate β
    location_log_prob: Tensor | None = None  # (B,) log α_{t,s̃}, hard attention when sampling
    entropy: Tensor | None = None  # (B,) H[α_t], hard attention only
    location: Tensor | None = None  # (B,) long s̃_t, hard attention when it reads one cell


@dataclass(frozen=True)
class DecoderState:
    """LSTM state (``k`` consecutive rows per image) and the per-image tensors, held once."""

    h: Tensor  # (B*k, n)
    c: Tensor  # (B*k, n)
    annotations: Tensor  # (B, L, D)
    projected: Tensor  # (B, L, A), W_a a_i + b of Eq. 4, once per image

    def reorder(self, index: Tensor) -> DecoderState:
        """Select rows of the LSTM state (beam search); a beam stays within its image, so the
        per-image tensors stay as they are."""
        return dataclasses.replace(self, h=self.h[index], c=self.c[index])


@dataclass(frozen=True)
class StepOutput:
    logits: Tensor  # (B, K), Eq. 7 before the softmax
    alpha: Tensor  # (B, L)
    state: DecoderState
    beta: Tensor | None = None  # (B,)
    location_log_prob: Tensor | None = None  # (B,)
    entropy: Tensor | None = None  # (B,)
    location: Tensor | None = None  # (B,) long s̃_t, the cell read (hard attention, not expected)


@dataclass(frozen=True)
class ForwardOutput:
    logits: Tensor  # (B, T, K)
    alphas: Tensor  # (B, T, L)
    betas: Tensor  # (B, T)
    location_log_probs: Tensor | None = None  # (B, T), hard attention in train/sample mode
    entropy: Tensor | None = None  # (B, T), hard attention
    sampled: Tensor | None = None  # (B,) bool, True where s̃ was sampled (not semi-sampling's α)
