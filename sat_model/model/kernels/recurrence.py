"""The teacher-forced recurrence of a training pass as one autograd node over the kernels.

Dimensions as in ``decoder.py`` (docs/METHOD.md): ``T`` caption steps, ``B`` captions, ``L``
locations, ``D`` annotation size, ``n`` LSTM size, ``A`` attention-MLP size.

The T steps of Eq. 1-6 with the gate β (Sec. 4.2.1), soft attention's expected context or
hard attention's sampled one with semi-sampling (Sec. 4.1), run forward in one call into
``native_kernels.cpp`` and back through time in another; the weight gradients are then one
matrix product each over all T·B rows. ``tests/sat_model/model/test_backend.py`` holds the
loss and every gradient to the readable model's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sat_model.model.kernels.native import NativeKernels, call

__all__ = ["RecurrenceOutput", "Weights", "recurrence"]


@dataclass(frozen=True)
class Weights:
    """The recurrence's weights, in the layouts the kernels take."""

    hidden2: Tensor  # (A, n), 2 W_h: the scores take σ(2u) (docs/METHOD.md)
    score: Tensor  # (1, A), w_att
    gate: Tensor | None  # (1, n), f_β's weight; None without the gate
    gate_bias: Tensor | None  # (1,)
    lstm: Tensor  # (4n, D + n), [W_z W_h] of Eq. 1 without the embedding's columns


@dataclass(frozen=True)
class RecurrenceOutput:
    """What the T steps hand to the deep output and the loss, (T, B, ·) each."""

    hidden: Tensor  # (T, B, n), h_1 .. h_T
    context: Tensor  # (T, B, D), ẑ_t = β_t φ_t
    alphas: Tensor  # (T, B, L), Eq. 5
    betas: Tensor  # (T, B), β_t (ones without the gate)
    location_log_probs: Tensor | None = None  # (T, B), log α_{t,s̃_t}, hard attention
    entropy: Tensor | None = None  # (T, B), H[α_t], hard attention


def recurrence(
    kernels: NativeKernels,
    projected: Tensor,
    annotations: Tensor,
    initial: tuple[Tensor, Tensor],
    input_gates: Tensor,
    weights: Weights,
    hard: tuple[Tensor, Tensor | None] | None = None,
) -> RecurrenceOutput:
    """``projected`` (B, A, L) is 2(W_a a + b) locations last; ``annotations`` (B, L, D);
    ``initial`` h_0, c_0 (B, n); ``input_gates`` (T, B, 4n) the embedding's share of the gates
    with both biases, in ``nn.LSTMCell``'s order (i, f, g, o). ``hard``: hard attention's
    semi-sampling mask (B,) bool and forced locations s̃ (T, B), or None to draw them."""
    w = weights
    tensors: list[Tensor | None] = [projected, annotations, *initial, input_gates, w.hidden2]
    tensors += [w.score, w.gate, w.gate_bias, w.lstm]
    use_expected, locations = hard if hard is not None else (None, None)
    outputs = _Recurrence.apply(kernels, *(_c(t) for t in tensors), _c(use_expected), _c(locations))
    return RecurrenceOutput(*outputs)


def _c(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


class _Recurrence(torch.autograd.Function):
    """``recurrence``'s node: forward in one kernel call, backward through time in another."""

    @staticmethod
    def forward(
        ctx: Any,
        kernels: NativeKernels,
        projected: Tensor,
        annotations: Tensor,
        h0: Tensor,
        c0: Tensor,
        input_gates: Tensor,
        *rest: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        hidden2, score, gate, gate_bias, lstm, use_expected, locations = rest
        T, B, _ = input_gates.shape
        _, L, D = annotations.shape
        n, A = h0.size(1), projected.size(1)
        new = h0.new_empty
        inputs, cells = new(T, B, D + n), new(T + 1, B, n)  # [ẑ_t; h_{t-1}], c_0 .. c_T
        inputs[0, :, D:], cells[0] = h0, c0
        seq = [inputs, cells, new(T, B, 4 * n), new(T, B, A), new(T, B, L), new(T, B, D)]
        seq += [new(T, B), new(T, B, n)]  # β, h_1 .. h_T
        assert score is not None
        pointers: list[Tensor | None] = [projected, annotations, input_gates, hidden2, 2.0 * score]
        pointers += [gate, gate_bias, lstm]
        hard: list[Tensor] = []
        if use_expected is None:
            run = kernels.soft_recurrence_forward
        else:
            run = kernels.hard_recurrence_forward
            sampled = locations is None
            if locations is None:
                locations = input_gates.new_empty(T, B, dtype=torch.long)
            # s̃ from T·B uniforms in the order the readable loop draws them (Eq. 8)
            uniforms = torch.rand(T, B, dtype=h0.dtype) if sampled else None
            hard = [new(T, B, L), new(T, B), new(T, B)]  # log α, log α_{t,s̃}, H[α_t]
            pointers += [use_expected, uniforms, locations]
        call(functools.partial(run, kernels.sgemm), [*pointers, *seq, *hard], T, B, A, L, D, n)
        ctx.kernels = kernels
        kept = (use_expected, locations, hard[0], hard[2]) if hard else (None,) * 4
        ctx.save_for_backward(projected, annotations, hidden2, score, gate, lstm, *seq, *kept)
        outputs = (seq[7], inputs[:, :, :D], seq[4], seq[6])
        return outputs if not hard else (*outputs, hard[1], hard[2])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *d_outputs: Tensor) -> tuple[Tensor | None, ...]:
        projected, annotations, hidden2, score, gate, lstm, *seq = ctx.saved_tensors
        inputs, cells, gates, queries, alphas, contexts, betas, hidden = seq[:8]
        use_expected, locations, log_alphas, entropy = seq[8:]
        T, B, n = hidden.shape
        A, L, D = projected.size(1), projected.size(2), annotations.size(2)
        kernels, new = ctx.kernels, projected.new_empty
        grads = [hidden.new_zeros(B, n), hidden.new_zeros(B, n), new(T, B, 4 * n)]
        grads += [new(T, B, A), hidden.new_zeros(T, B)]  # ∂ queries, ∂ f_β's pre-activation
        weight_rows, grad_projected = new(T, B, A), torch.empty_like(projected)
        scratch = [new(B, D + n), new(B, D)]
        pointers = [projected, annotations, hidden2, 2.0 * score, gate, lstm]
        steps = [cells, gates, queries, alphas, contexts, betas]
        if use_expected is None:
            run = kernels.soft_recurrence_backward
        else:
            run = kernels.hard_recurrence_backward
            pointers += [use_expected, locations]
            steps += [log_alphas, entropy]
            scratch.append(new(B, L))  # ∂/∂ the scores
        d_outputs = tuple(d.contiguous() for d in d_outputs)
        pointers += [*steps, *d_outputs, *grads, weight_rows, grad_projected, *scratch]
        call(functools.partial(run, kernels.sgemm), pointers, T, B, A, L, D, n)
        grad_h, grad_c, grad_gates, grad_queries, gate_pre = grads
        h_prev = inputs[:, :, D:].reshape(T * B, n)  # (T·B, n), h_0 .. h_{T-1}
        grad_gate = grad_gate_bias = None
        if gate is not None:
            grad_gate = torch.mm(gate_pre.view(1, T * B), h_prev)  # (1, n)
            grad_gate_bias = gate_pre.sum().view(1)
        return (
            None,  # the kernels
            grad_projected,
            None,  # the annotations are held fixed (the backend declines where they need one)
            grad_h,
            grad_c,
            grad_gates,  # the embedding's share of the gates
            torch.mm(grad_queries.view(T * B, A).t(), h_prev),  # (A, n), ∂/∂ 2 W_h
            (2.0 * weight_rows.sum((0, 1))).view(1, A),  # ∂/∂w_att
            grad_gate,
            grad_gate_bias,
            torch.mm(grad_gates.view(T * B, -1).t(), inputs.view(T * B, -1)),  # (4n, D + n)
            None,  # use_expected
            None,  # locations
        )
