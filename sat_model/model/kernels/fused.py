"""Hand-fused autograd functions of the decoder's training pass (issue #20).

Dimensions as in ``decoder.py`` (docs/METHOD.md): ``B`` batch, ``T`` caption steps, ``L``
locations, ``D`` annotation size, ``n`` LSTM size, ``A`` attention-MLP size; ``k`` rows per image
(beams).

- ``FusedScores``: the attention scores 2 w_att^T σ(P + q), ``SoftAttention.scores`` (Eq. 4
  with tanh(u) = 2σ(2u) - 1), a few images at a time (``score_chunks``), its backward
  recomputing σ rather than keeping the (B*k, A, L) tensor. Used by every per-step pass
  (decoding, hard attention).
- ``recurrence``: the whole teacher-forced recurrence of a training pass (Eq. 1-6 and the gate
  β, Sec. 4.2.1; soft attention's expected context, or hard attention's sampled one with
  semi-sampling, Sec. 4.1) over T steps as one autograd node. Its forward runs the steps without
  building a graph and keeps what the backward needs; its backward is back-propagation through
  time written out, so that the weight gradients of the LSTM, W_h and f_β are one matrix product
  each over all T·B rows rather than T small ones, and the step's products take their faster
  layouts. ``tests/sat_model/test_fused.py`` checks it against finite differences and the step
  loop, ``test_backend.py`` the whole training loss and gradients against the readable model;
  ``benchmarks/bench_model.py`` times it (docs/EXPERIMENTS.md, "Training speed").

On float32 CPU tensors the recurrence's T steps, forward and backward, each run in one call into
the compiled kernels of ``native.py`` where they could be built (``_compiled_forward``,
``_compiled_backward``), and where torch exports no BLAS for them the scores, soft attention's
step and the LSTM cell do, step by step; the PyTorch code here is what runs without them, and
always in float64 (the gradient checks) and under other dtypes or devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sat_model.model.kernels import native

__all__ = [
    "SCORE_CHUNK_ELEMENTS",
    "CollectProjected",
    "FusedScores",
    "HardPath",
    "ProjectedGradient",
    "RecurrenceOutput",
    "expected_context",
    "fused_scores",
    "fused_scores_backward",
    "gather_location",
    "recurrence",
    "sample_locations",
    "score_chunks",
]

# Elements of the (rows, A, L) attention tensor that ``FusedScores`` handles at a time (~4 MiB
# of float32): the add, σ and product, and backward their recomputation and gradients, then run
# in cache instead of streaming the step's largest tensor through memory pass after pass.
SCORE_CHUNK_ELEMENTS = 1 << 20


class ProjectedGradient:
    """Where the fused scores of all steps add up their gradient for 2(W_a a + b) (B, A, L), in
    place, rather than each step handing autograd a (B, A, L) tensor to sum."""

    def __init__(self) -> None:
        self.grad: Tensor | None = None


class CollectProjected(torch.autograd.Function):
    """Identity on ``projected`` whose backward returns what the steps left in the sink.
    Every step takes its output, so autograd runs this backward after all of theirs."""

    @staticmethod
    def forward(ctx: Any, projected: Tensor, sink: ProjectedGradient) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.sink = sink
        ctx.dtype = projected.dtype  # the sink may sum in a wider one (autocast)
        return projected.view_as(projected)

    @staticmethod
    def backward(ctx: Any, _none: Tensor | None) -> tuple[Tensor | None, None]:
        grad, ctx.sink.grad = ctx.sink.grad, None
        return None if grad is None else grad.to(ctx.dtype), None


class FusedScores(torch.autograd.Function):
    """2 w_att^T σ(P + q): (B, A, L), (B*k, A), (1, A) -> (B*k, L), a few images at a time; the
    backward recomputes σ rather than keeping it (Eq. 4 as in ``backend.py``). The three inputs
    share one dtype (the caller's cast); autocast is off inside, so that it casts nothing."""

    @staticmethod
    def forward(
        ctx: Any, projected: Tensor, hidden: Tensor, weight: Tensor, sink: ProjectedGradient | None
    ) -> Tensor:
        ctx.save_for_backward(projected, hidden, weight)
        ctx.sink = sink
        ctx.native = native.is_enabled()  # the backend's choice, for the backward too
        with torch.autocast(projected.device.type, enabled=False):
            return fused_scores(projected, hidden, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor, Tensor, None]:
        projected, hidden, weight = ctx.saved_tensors
        sink = ctx.sink if ctx.needs_input_grad[0] else None
        with torch.autocast(projected.device.type, enabled=False), native.enabled(ctx.native):
            grads = fused_scores_backward(
                grad.to(projected.dtype), projected, hidden, weight, ctx.needs_input_grad[0], sink
            )
        return (*grads, None)


def fused_scores(projected: Tensor, hidden: Tensor, weight: Tensor) -> Tensor:
    """The forward of ``FusedScores``: (B*k, L). Through the compiled kernel where it runs
    (``native.py``), else in PyTorch's ops over the ranges of ``score_chunks``."""
    native_scores = native.scores_forward(projected, hidden, weight)
    if native_scores is not None:
        return native_scores
    B, A, L = projected.shape
    k = hidden.size(0) // B  # rows per image (beams)
    scores = projected.new_empty(B * k, L)
    weight2 = (2.0 * weight).view(1, 1, A)
    for b0, b1 in score_chunks(B, k * A * L):
        sig = _sigmoid_of_sum(projected, hidden, b0, b1)  # (rows, A, L)
        rows = sig.size(0)
        torch.bmm(weight2.expand(rows, 1, A), sig, out=scores[b0 * k : b1 * k].unsqueeze(1))
    return scores


def fused_scores_backward(
    grad: Tensor,
    projected: Tensor,
    hidden: Tensor,
    weight: Tensor,
    needs_projected: bool,
    sink: ProjectedGradient | None,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """The backward of ``FusedScores`` for ``grad`` (B*k, L): the gradients for ``projected``
    (None when not needed, or when it went into ``sink``), ``hidden`` and ``weight``; through
    the compiled kernel where it runs (``native.py``)."""
    held = sink.grad if needs_projected and sink is not None else None
    native_grads = native.scores_backward(grad, projected, hidden, weight, held)
    if native_grads is not None:
        native_projected, native_hidden, native_weight = native_grads
        if not needs_projected:
            return None, native_hidden, native_weight
        if sink is not None:
            sink.grad = native_projected
            return None, native_hidden, native_weight
        return native_projected, native_hidden, native_weight
    B, A, L = projected.shape
    k = hidden.size(0) // B
    out: Tensor | None = None  # (B, A, L), ∂/∂P: this step's own or the sink's running sum
    accumulate = False
    if needs_projected:
        accumulate = held is not None
        # the sink sums over all steps: in float32 at least, whatever autocast's dtype
        dtype = (
            projected.dtype if sink is None else torch.promote_types(projected.dtype, torch.float32)
        )
        out = held if held is not None else projected.new_empty(B, A, L, dtype=dtype)
    grad_hidden = hidden.new_empty(B * k, A)
    grad_weight = weight.new_zeros(A)
    weight2 = (2.0 * weight).view(1, A, 1)
    for b0, b1 in score_chunks(B, k * A * L):
        sig = _sigmoid_of_sum(projected, hidden, b0, b1)  # (rows, A, L)
        g = grad[b0 * k : b1 * k].unsqueeze(1)  # (rows, 1, L)
        # an elementwise product and a sum, not bmm(σ, g): MKL's batched matrix-vector
        # product is slower at these shapes (docs/EXPERIMENTS.md)
        pre = torch.mul(sig, g)  # (rows, A, L), σ g
        grad_weight += pre.sum((0, 2))  # (A,), Σ σ g
        pre.addcmul_(pre, sig, value=-1.0)  # σ (1 - σ) g = ∂/∂(P + q) before w_att
        torch.sum(pre, dim=2, out=grad_hidden[b0 * k : b1 * k])
        if out is not None:
            per_image = pre if k == 1 else pre.view(b1 - b0, k, A, L).sum(1)
            if accumulate:
                out[b0:b1].addcmul_(per_image, weight2)
            else:
                torch.mul(per_image, weight2, out=out[b0:b1])
    grad_hidden.mul_(weight2.view(1, A))
    if sink is not None and out is not None:
        sink.grad, out = out, None
    return out, grad_hidden, (2.0 * grad_weight).view(1, A)


def score_chunks(images: int, per_image: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of images of about ``SCORE_CHUNK_ELEMENTS`` elements each, so that a
    chunk's (rows, A, L) tensor stays in the CPU's cache through its passes."""
    step = max(1, SCORE_CHUNK_ELEMENTS // per_image)
    return [(b0, min(b0 + step, images)) for b0 in range(0, images, step)]


def _sigmoid_of_sum(projected: Tensor, hidden: Tensor, b0: int, b1: int) -> Tensor:
    """σ(P + q) for images [b0, b1) and their k rows each: (rows, A, L)."""
    B, A, L = projected.shape
    k = hidden.size(0) // B
    pre = projected[b0:b1].unsqueeze(1) + hidden[b0 * k : b1 * k].view(b1 - b0, k, A, 1)
    return pre.sigmoid_().view(-1, A, L)  # in place: one allocation


@dataclass(frozen=True)
class RecurrenceOutput:
    """What the T steps of ``recurrence`` hand to the output layer and the loss."""

    hidden: Tensor  # (T, B, n), h_1 .. h_T
    context: Tensor  # (T, B, D), ẑ_t = β_t φ_t, the LSTM's and L_z's input
    alphas: Tensor  # (T, B, L), Eq. 5
    betas: Tensor  # (T, B), β_t (ones without the gate)
    location_log_probs: Tensor | None = None  # (T, B), log α_{t,s̃_t}, hard attention
    entropy: Tensor | None = None  # (T, B), H[α_t], hard attention


@dataclass(frozen=True)
class HardPath:
    """Hard attention's share of a training pass (Sec. 4.1): which images use the expected
    context (semi-sampling) and, optionally, forced locations s̃ (T, B); without them s̃_t is
    drawn from α_t inside the recurrence, one ``torch.rand`` per step as the step loop draws."""

    use_expected: Tensor  # (B,) bool
    locations: Tensor | None = None  # (T, B) long


def recurrence(
    projected: Tensor,
    annotations: Tensor,
    h0: Tensor,
    c0: Tensor,
    input_gates: Tensor,
    *,
    hidden_weight: Tensor,
    score_weight: Tensor,
    gate_weight: Tensor | None,
    gate_bias: Tensor | None,
    weight_z: Tensor,
    weight_h: Tensor,
    hard: HardPath | None = None,
) -> RecurrenceOutput:
    """The teacher-forced recurrence (Eq. 1-6, β of Sec. 4.2.1) as one autograd node: soft
    attention's expected context, or with ``hard`` the sampled one of Eq. 8-9.

    ``projected`` (B, A, L) is ``SoftAttention.project``'s 2(W_a a + b); ``annotations``
    (B, L, D); ``h0``, ``c0`` (B, n); ``input_gates`` (T, B, 4n) the embedding's share of the
    LSTM gates with both biases. The weights: W_h (A, n), w_att (1, A), f_β's (1, n) and (1,)
    (None without the gate), and the LSTM's for ẑ_t (4n, D) and h_{t-1} (4n, n), gates in
    ``nn.LSTMCell``'s order (i, f, g, o). The same numbers as the per-step ``ShowAttendTell``
    path, up to float rounding.
    """
    outputs = _Recurrence.apply(
        projected,
        annotations,
        h0,
        c0,
        input_gates,
        hidden_weight,
        score_weight,
        gate_weight,
        gate_bias,
        torch.cat([weight_z, weight_h], dim=1),  # (4n, D + n): one product per step
        None if hard is None else hard.use_expected,
        None if hard is None else hard.locations,
    )
    return RecurrenceOutput(*outputs[:4], *(outputs[4:] if hard is not None else ()))


@dataclass(frozen=True)
class _Weights:
    hidden2: Tensor  # (A, n), 2 W_h: σ(2u) takes 2u (backend.py, Eq. 4)
    score: Tensor  # (1, A), w_att
    gate: Tensor | None  # (1, n)
    gate_bias: Tensor | None  # (1,)
    lstm: Tensor  # (4n, D + n), [W_z W_h] of Eq. 1 without the embedding's columns

    @classmethod
    def of(
        cls,
        hidden: Tensor,
        score: Tensor,
        gate: Tensor | None,
        gate_bias: Tensor | None,
        lstm: Tensor,
    ) -> _Weights:
        return cls(2.0 * hidden, score, gate, gate_bias, lstm)


@dataclass(frozen=True)
class _Sequence:
    """What the forward keeps for the backward, one slice per step."""

    inputs: Tensor  # (T, B, D + n), [ẑ_t; h_{t-1}]: the LSTM's inputs beside the embedding
    cells: Tensor  # (T + 1, B, n), c_0 .. c_T
    gates: Tensor  # (T, B, 4n), σ(i), σ(f), tanh(g), σ(o)
    queries: Tensor  # (T, B, A), 2 W_h h_{t-1}
    alphas: Tensor  # (T, B, L)
    contexts: Tensor  # (T, B, D), φ_t: Σ_i α_ti a_i, or a_{s̃_t} (hard), before the gate
    betas: Tensor  # (T, B)
    hidden: Tensor  # (T, B, n), h_1 .. h_T
    # hard attention only (None for soft)
    use_expected: Tensor | None = None  # (B,) bool, semi-sampling
    locations: Tensor | None = None  # (T, B) long, s̃_t
    log_alphas: Tensor | None = None  # (T, B, L)
    log_probs: Tensor | None = None  # (T, B), log α_{t,s̃_t}
    entropy: Tensor | None = None  # (T, B), H[α_t]

    @classmethod
    def empty(cls, like: Tensor, T: int, B: int, L: int, D: int, n: int, A: int) -> _Sequence:
        return cls(
            inputs=like.new_empty(T, B, D + n),
            cells=like.new_empty(T + 1, B, n),
            gates=like.new_empty(T, B, 4 * n),
            queries=like.new_empty(T, B, A),
            alphas=like.new_empty(T, B, L),
            contexts=like.new_empty(T, B, D),
            betas=like.new_empty(T, B),
            hidden=like.new_empty(T, B, n),
        )

    def with_hard(self, use_expected: Tensor, locations: Tensor) -> _Sequence:
        T, B, L = self.alphas.shape
        return dataclasses.replace(
            self,
            use_expected=use_expected,
            locations=locations,
            log_alphas=self.alphas.new_empty(T, B, L),
            log_probs=self.alphas.new_empty(T, B),
            entropy=self.alphas.new_empty(T, B),
        )


class _Recurrence(torch.autograd.Function):
    """``recurrence``'s node: forward step by step, backward through time by hand."""

    @staticmethod
    def forward(
        ctx: Any,
        projected: Tensor,
        annotations: Tensor,
        h0: Tensor,
        c0: Tensor,
        input_gates: Tensor,
        hidden_weight: Tensor,
        score_weight: Tensor,
        gate_weight: Tensor | None,
        gate_bias: Tensor | None,
        lstm_weight: Tensor,
        use_expected: Tensor | None,
        locations: Tensor | None,
    ) -> tuple[Tensor, ...]:
        T, B, _ = input_gates.shape
        _, L, D = annotations.shape
        n, A = h0.size(1), projected.size(1)
        weights = (hidden_weight, score_weight, gate_weight, gate_bias, lstm_weight)
        w = _Weights.of(*weights)
        seq = _Sequence.empty(h0, T, B, L, D, n, A)
        sample = use_expected is not None and locations is None
        if use_expected is not None:  # hard attention; s̃ drawn step by step unless forced
            if locations is None:
                locations = input_gates.new_empty(T, B, dtype=torch.long)
            seq = seq.with_hard(use_expected, locations)
        seq.inputs[0, :, D:] = h0
        seq.cells[0] = c0
        if not _compiled_forward(seq, w, projected, annotations, input_gates, sample):
            for t in range(T):
                _forward_step(t, seq, w, projected, annotations, input_gates[t], sample)
        ctx.save_for_backward(projected, annotations, *weights, *_tensors(seq))
        ctx.native = native.is_enabled()  # the backend's choice, for the backward too
        outputs = (seq.hidden, seq.inputs[:, :, :D], seq.alphas, seq.betas)
        if seq.log_probs is None or seq.entropy is None:
            return outputs
        return (*outputs, seq.log_probs, seq.entropy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *d_outputs: Tensor) -> tuple[Tensor | None, ...]:
        with native.enabled(ctx.native):
            return _recurrence_backward(ctx, d_outputs)


def _recurrence_backward(ctx: Any, d_outputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """``_Recurrence.backward``: through time by hand, in one compiled call where it runs."""
    projected, annotations, *saved = ctx.saved_tensors
    w, seq = _Weights.of(*saved[:5]), _Sequence(*saved[5:])
    need = ctx.needs_input_grad
    grads = _Gradients.zeros(seq, w, annotations if need[1] else None)
    sink = ProjectedGradient() if need[0] else None
    whole = None  # the T steps in one compiled call, where it runs
    if sink is not None and grads.annotations is None:
        whole = _compiled_backward(seq, w, projected, annotations, d_outputs, grads)
    if whole is not None and sink is not None:
        sink.grad, grads.score = whole
    else:
        for t in range(seq.gates.size(0) - 1, -1, -1):
            _backward_step(t, seq, w, projected, annotations, d_outputs, grads, sink)
    return (
        sink.grad if sink is not None else None,
        grads.annotations,
        grads.h,
        grads.c,
        grads.gates,  # the embedding's share of the gates: ∂/∂ of each step's gates
        *_weight_gradients(seq, w, grads),
        None,  # use_expected
        None,  # locations
    )


def _tensors(seq: _Sequence) -> list[Tensor | None]:
    return [getattr(seq, f.name) for f in dataclasses.fields(seq)]


def _compiled_forward(
    seq: _Sequence,
    w: _Weights,
    projected: Tensor,
    annotations: Tensor,
    input_gates: Tensor,
    sample: bool,
) -> bool:
    """The T steps of ``_forward_step`` in one compiled call (``native``), soft or hard; False,
    with nothing written or drawn, where it cannot run."""
    weights = (w.hidden2, w.score, w.gate, w.gate_bias, w.lstm)
    steps = [seq.inputs, seq.cells, seq.gates, seq.queries, seq.alphas, seq.contexts, seq.betas]
    steps.append(seq.hidden)
    if seq.use_expected is None:
        return native.soft_recurrence_forward(projected, annotations, input_gates, *weights, steps)
    assert seq.locations is not None and seq.log_alphas is not None
    assert seq.log_probs is not None and seq.entropy is not None
    hard = [seq.log_alphas, seq.log_probs, seq.entropy]
    return native.hard_recurrence_forward(
        projected,
        annotations,
        input_gates,
        *weights,
        seq.use_expected,
        seq.locations,
        sample,
        steps + hard,
    )


def _compiled_backward(
    seq: _Sequence,
    w: _Weights,
    projected: Tensor,
    annotations: Tensor,
    d_outputs: tuple[Tensor, ...],
    grads: _Gradients,
) -> tuple[Tensor, Tensor] | None:
    """``_compiled_forward`` backwards: ∂/∂projected and ∂/∂w_att, ``grads`` filled as the
    step-by-step backward fills them; None, with nothing written, where it cannot run."""
    steps = [seq.cells, seq.gates, seq.queries, seq.alphas, seq.contexts, seq.betas]
    sums = [grads.h, grads.c, grads.gates, grads.queries, grads.gate_pre]
    if seq.use_expected is None:
        return native.soft_recurrence_backward(
            projected, annotations, w.hidden2, w.score, w.gate, w.lstm, steps, list(d_outputs), sums
        )
    assert seq.locations is not None and seq.log_alphas is not None and seq.entropy is not None
    return native.hard_recurrence_backward(
        projected,
        annotations,
        w.hidden2,
        w.score,
        w.gate,
        w.lstm,
        seq.use_expected,
        seq.locations,
        [*steps, seq.log_alphas, seq.entropy],
        list(d_outputs),
        sums,
    )


def expected_context(annotations: Tensor, alpha: Tensor) -> Tensor:
    """Σ_i α_i a_i (Sec. 4.2): (B, L, D), (B*k, L) -> (B*k, D); the k rows of an image in one
    matrix product, so its annotations are read once, not once per beam."""
    B, L, D = annotations.shape
    return torch.bmm(alpha.view(B, -1, L), annotations).view(-1, D)


def gather_location(annotations: Tensor, location: Tensor) -> Tensor:
    """a_{s̃}: (B, L, D), (B*k,) -> (B*k, D); the one-hot sum of Eq. 9 without the multiply."""
    B, _, D = annotations.shape
    index = location.view(B, -1, 1).expand(-1, -1, D)  # (B, k, D)
    return annotations.gather(1, index).view(-1, D)


def sample_locations(alpha: Tensor) -> Tensor:
    """s̃ ~ Multinoulli(α) (Eq. 8) as an index (B,), by the inverse CDF: the first location
    whose cumulative α exceeds u ~ U[0, Σα). The same distribution as ``torch.multinomial``,
    which draws L exponentials per row and is slower (docs/EXPERIMENTS.md)."""
    cdf = alpha.detach().cumsum(-1)  # (B, L)
    u = torch.rand_like(cdf[:, :1]) * cdf[:, -1:]  # (B, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=alpha.size(-1) - 1)


def _forward_step(
    t: int,
    seq: _Sequence,
    w: _Weights,
    projected: Tensor,
    annotations: Tensor,
    gates_in: Tensor,
    sample: bool,
) -> None:
    """Step t of Eq. 1-6 into ``seq``: attention from h_{t-1}, gate, LSTM."""
    D, n = annotations.size(2), seq.cells.size(2)
    h = seq.inputs[t, :, D:]  # (B, n), h_{t-1}
    q = torch.mm(h, w.hidden2.t(), out=seq.queries[t])  # (B, A)
    context = seq.contexts[t]  # (B, D)
    if seq.log_alphas is None:  # soft: Eq. 4-5 and Σ α a, in one kernel where it runs
        alpha = seq.alphas[t]
        if not native.attend_forward(projected, q, w.score, annotations, alpha, context):
            torch.softmax(fused_scores(projected, q, w.score), dim=-1, out=alpha)
            torch.bmm(alpha.unsqueeze(1), annotations, out=context.unsqueeze(1))
    else:
        _hard_attention(t, seq, fused_scores(projected, q, w.score), annotations, sample)
    z = seq.inputs[t, :, :D]  # (B, D), ẑ_t
    if w.gate is not None and w.gate_bias is not None:
        beta = torch.sigmoid(torch.addmm(w.gate_bias, h, w.gate.t())).squeeze(1)  # (B,)
        seq.betas[t] = beta
        torch.mul(context, beta.unsqueeze(1), out=z)
    else:
        seq.betas[t] = 1.0
        z.copy_(context)
    gates = torch.addmm(gates_in, seq.inputs[t], w.lstm.t(), out=seq.gates[t])  # (B, 4n), Eq. 1
    next_input = seq.inputs[t + 1, :, D:] if t + 1 < seq.inputs.size(0) else None
    if native.lstm_forward(gates, seq.cells[t], seq.cells[t + 1], seq.hidden[t], next_input):
        return
    torch.tanh_(gates[:, 2 * n : 3 * n])
    gates[:, : 2 * n].sigmoid_()
    gates[:, 3 * n :].sigmoid_()
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.addcmul(f * seq.cells[t], i, g, out=seq.cells[t + 1])  # Eq. 2
    torch.mul(o, torch.tanh(c), out=seq.hidden[t])  # Eq. 3
    if next_input is not None:
        next_input.copy_(seq.hidden[t])


def _hard_attention(
    t: int, seq: _Sequence, scores: Tensor, annotations: Tensor, sample: bool
) -> None:
    """α_t, H[α_t], s̃_t and φ_t (Eq. 8-9; α where semi-sampling picked it) as
    ``HardAttention.forward`` computes them in training."""
    assert seq.log_alphas is not None and seq.locations is not None
    assert seq.use_expected is not None and seq.log_probs is not None and seq.entropy is not None
    log_alpha = torch.log_softmax(scores, dim=-1)  # (B, L)
    alpha = log_alpha.exp()
    seq.log_alphas[t], seq.alphas[t] = log_alpha, alpha
    seq.entropy[t] = -(alpha * log_alpha).sum(-1)  # H[α_t], the entropy term of Sec. 4.1
    if sample:
        seq.locations[t] = sample_locations(alpha)
    location = seq.locations[t]  # (B,)
    phi = (expected_context(annotations, alpha), gather_location(annotations, location))
    torch.where(seq.use_expected.unsqueeze(1), *phi, out=seq.contexts[t])  # (B, D)
    seq.log_probs[t] = log_alpha.gather(1, location.unsqueeze(1)).squeeze(1)


@dataclass
class _Gradients:
    """What the backward carries from step t to t-1 and gathers over the steps."""

    h: Tensor  # (B, n), ∂/∂h_t from the later steps
    c: Tensor  # (B, n), ∂/∂c_t from the later steps
    gates: Tensor  # (T, B, 4n), ∂/∂ the gates' pre-activations
    queries: Tensor  # (T, B, A), ∂/∂(2 W_h h_{t-1})
    gate_pre: Tensor  # (T, B), ∂/∂ f_β(h_{t-1})
    score: Tensor  # (1, A), ∂/∂w_att
    annotations: Tensor | None  # (B, L, D), only when the annotations need a gradient

    @classmethod
    def zeros(cls, seq: _Sequence, w: _Weights, annotations: Tensor | None) -> _Gradients:
        T, B, n = seq.hidden.shape
        return cls(
            h=seq.hidden.new_zeros(B, n),
            c=seq.hidden.new_zeros(B, n),
            gates=seq.gates.new_empty(seq.gates.shape),
            queries=seq.queries.new_empty(seq.queries.shape),
            gate_pre=seq.betas.new_zeros(T, B),
            score=torch.zeros_like(w.score),
            annotations=None if annotations is None else torch.zeros_like(annotations),
        )


def _backward_step(
    t: int,
    seq: _Sequence,
    w: _Weights,
    projected: Tensor,
    annotations: Tensor,
    d_outputs: tuple[Tensor, ...],
    grads: _Gradients,
    sink: ProjectedGradient | None,
) -> None:
    """Step t backwards: from ∂/∂h_t, ∂/∂c_t to ∂/∂h_{t-1}, ∂/∂c_{t-1}, keeping what the
    weight gradients need."""
    d_hidden, d_context, _, d_betas = d_outputs[:4]
    D = annotations.size(2)
    dz = _lstm_backward(t, seq, w, d_hidden[t], grads)  # (B, D + n) -> ẑ_t's share
    dh = dz[:, D:]  # (B, n), ∂/∂h_{t-1} through Eq. 1
    dz = dz[:, :D] + d_context[t]  # (B, D), ∂/∂ẑ_t
    if w.gate is not None:
        beta = seq.betas[t]
        d_beta = (dz * seq.contexts[t]).sum(1) + d_betas[t]  # (B,)
        d_pre = torch.mul(d_beta, beta * (1.0 - beta), out=grads.gate_pre[t])  # σ'
        dh = dh.addcmul(d_pre.unsqueeze(1), w.gate)  # f_β's share of ∂/∂h_{t-1}
        dz = dz * beta.unsqueeze(1)  # ∂/∂φ_t
    d_query = grads.queries[t]
    native_grads = None
    if sink is not None and seq.log_alphas is None and grads.annotations is None:
        # soft attention's backward from ∂/∂φ in one kernel where it runs
        native_grads = native.attend_backward(
            dz,
            d_outputs[2][t],
            seq.alphas[t],
            annotations,
            projected,
            seq.queries[t],
            w.score,
            sink.grad,
            d_query,
        )
        if native_grads is not None:
            sink.grad, d_score = native_grads
    if native_grads is None:
        d_scores = _attention_backward(t, seq, annotations, dz, d_outputs, grads)
        _, d_step_query, d_score = fused_scores_backward(
            d_scores, projected, seq.queries[t], w.score, sink is not None, sink
        )
        d_query.copy_(d_step_query)
    grads.score += d_score
    grads.h = dh.addmm_(d_query, w.hidden2)  # W_h's share of ∂/∂h_{t-1}


def _attention_backward(
    t: int,
    seq: _Sequence,
    annotations: Tensor,
    d_phi: Tensor,
    d_outputs: tuple[Tensor, ...],
    grads: _Gradients,
) -> Tensor:
    """From ∂/∂φ_t (B, D) and the loss's ∂/∂α_t (and, hard, ∂/∂log α_{t,s̃}, ∂/∂H[α_t]) to
    ∂/∂ the scores e_t (B, L); the annotations' share into ``grads.annotations``."""
    B, _, D = annotations.shape
    alpha = seq.alphas[t]  # (B, L)
    if seq.use_expected is not None and seq.locations is not None:
        # φ = a_{s̃} for the sampled images: no gradient reaches α through it (Eq. 9)
        expected = seq.use_expected.unsqueeze(1)
        if grads.annotations is not None:
            index = seq.locations[t].view(B, 1, 1).expand(-1, -1, D)
            sampled = torch.where(expected, 0.0, d_phi).unsqueeze(1)  # (B, 1, D)
            grads.annotations.scatter_add_(1, index, sampled)
        d_phi = torch.where(expected, d_phi, 0.0)
    # ∂/∂α from the context (a product with a's transpose, MKL's fast layout) and the loss
    d_alpha = torch.bmm(d_phi.unsqueeze(1), annotations.transpose(1, 2)).squeeze(1)  # (B, L)
    d_alpha += d_outputs[2][t]
    if grads.annotations is not None:
        grads.annotations.baddbmm_(alpha.unsqueeze(2), d_phi.unsqueeze(1))  # (B, L, D)
    d_scores = alpha * (d_alpha - (alpha * d_alpha).sum(1, keepdim=True))  # softmax, Eq. 5
    if seq.log_alphas is not None and seq.entropy is not None and seq.locations is not None:
        d_log_prob, d_entropy = d_outputs[4][t].unsqueeze(1), d_outputs[5][t].unsqueeze(1)
        # ∂H/∂e = -α (log α + H); ∂ log α_s̃ / ∂e = onehot(s̃) - α
        entropy = seq.entropy[t].unsqueeze(1)
        d_scores -= d_entropy * alpha * (seq.log_alphas[t] + entropy)
        d_scores -= d_log_prob * alpha
        d_scores.scatter_add_(1, seq.locations[t].unsqueeze(1), d_log_prob)
    return d_scores


def _lstm_backward(
    t: int, seq: _Sequence, w: _Weights, d_hidden: Tensor, grads: _Gradients
) -> Tensor:
    """Eq. 1-3 backwards at step t: the gates' gradient into ``grads.gates[t]``, ∂/∂c_{t-1}
    into ``grads.c``; returns ∂/∂[ẑ_t; h_{t-1}] (B, D + n)."""
    cells = (seq.cells[t], seq.cells[t + 1])
    if native.lstm_backward(seq.gates[t], *cells, grads.h, d_hidden, grads.c, grads.gates[t]):
        return torch.mm(grads.gates[t], w.lstm)
    i, f, g, o = seq.gates[t].chunk(4, dim=1)
    tanh_c = torch.tanh(seq.cells[t + 1])
    dh = grads.h + d_hidden  # (B, n)
    dc = grads.c + dh * o * (1.0 - tanh_c * tanh_c)  # through h_t = o tanh(c_t)
    di, df, dg, do = grads.gates[t].chunk(4, dim=1)
    torch.mul(dh * tanh_c, o * (1.0 - o), out=do)
    torch.mul(dc * g, i * (1.0 - i), out=di)
    torch.mul(dc * seq.cells[t], f * (1.0 - f), out=df)
    torch.mul(dc * i, 1.0 - g * g, out=dg)
    grads.c = dc * f
    return torch.mm(grads.gates[t], w.lstm)  # (B, D + n)


def _weight_gradients(
    seq: _Sequence, w: _Weights, grads: _Gradients
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """∂/∂ W_h, w_att, f_β (weight, bias) and [W_z W_h]: one product over all T·B rows each."""
    T, B, n = seq.hidden.shape
    h_prev = seq.inputs[:, :, -n:].reshape(T * B, n)  # (T·B, n), h_0 .. h_{T-1}
    d_hidden = 2.0 * torch.mm(grads.queries.view(T * B, -1).t(), h_prev)  # (A, n)
    d_gate = d_gate_bias = None
    if w.gate is not None:
        d_gate = torch.mm(grads.gate_pre.view(1, T * B), h_prev)  # (1, n)
        d_gate_bias = grads.gate_pre.sum().view(1)
    d_lstm = torch.mm(grads.gates.view(T * B, -1).t(), seq.inputs.view(T * B, -1))  # (4n, D+n)
    return d_hidden, grads.score, d_gate, d_gate_bias, d_lstm
