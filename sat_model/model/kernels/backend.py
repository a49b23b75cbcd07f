"""The fast backend of ``ShowAttendTell``: the same functions as ``decoder.py``, computed faster.

``decoder.py`` is the paper; this module is where speed lives, so that no dispatch on device,
autograd or CPU reaches the equations. It takes a pass only where it was written for it and
returns None otherwise (then the readable code runs). It computes on CPU tensors only: on a GPU
the step waits on kernel launches, and autograd through the readable equations trained and
decoded faster there than these fused passes (docs/EXPERIMENTS.md, "The backend on a GPU").

- training passes (and any teacher-forced pass without autocast in the "train" or "expected"
  modes, or with forced locations for hard attention): the T steps of Eq. 1-6 as one autograd
  node with a hand-written backward (``fused.recurrence``), in one compiled call each way on
  float32 CPU tensors (``native.py``);
- decoding steps without autograd in the "expected" mode: the embedding's share of Eq. 1 from
  a table over the vocabulary, soft attention's scores, softmax and context in one compiled
  pass, and Eq. 2-3 in a compiled kernel after two BLAS products, or, for many rows on CPUs
  where MKL's sgemm is not the fast one, ``torch.lstm`` (oneDNN).

Eq. 4's scores go through tanh(u) = 2σ(2u) - 1: w_att^T tanh(u) = 2 w_att^T σ(2u) - Σ w_att,
whose last term is the same at every location and cancels in the softmax of Eq. 5, so α is
exactly Eq. 4-5's (docs/METHOD.md). ``tests/sat_model/test_backend.py`` holds every path here to
the readable model in float64; a model whose modules are not exactly the stock ones (``fits``)
never comes here. Machine-specific measurements behind the choices: docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import torch
from torch import Tensor, nn

from sat_model.model import decoder
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.kernels import native
from sat_model.model.kernels.fused import FusedScores, HardPath, recurrence
from sat_model.model.outputs import DecoderState, ForwardOutput, StepOutput

__all__ = [
    "GATE_TABLE_MAX_ELEMENTS",
    "ONEDNN_LSTM_MIN_ROWS",
    "FastBackend",
    "FastState",
    "dropout",
    "torch_lstm_step",
]

# Rows from which a decoding step on a CPU whose BLAS is not MKL's fast path runs the LSTM
# through torch.lstm (oneDNN's RNN primitive) rather than two BLAS products and the compiled
# kernel (docs/EXPERIMENTS.md, "Decoding's LSTM step"). Training always takes the BLAS: oneDNN's
# backward repacks the weights on every call.
ONEDNN_LSTM_MIN_ROWS = 128
# Decoding takes the embedding's share of the LSTM's gates from a (K, 4n) table when it has at
# most this many elements (64 MB in float32; the Flickr8k profile's is ~6 M, the paper's 72 M).
GATE_TABLE_MAX_ELEMENTS = 16_000_000
P = ParamSpec("P")
R = TypeVar("R")
# the equation methods and module types the backend computes; anything else runs the readable code
_EQUATIONS = ("prepare", "init_state", "advance", "deep_output", "semi_sampling_mask")
_LINEARS = ("init_h", "init_c", "hidden_out", "context_out", "out")


@dataclass(frozen=True)
class FastState:
    """What a decoding call keeps per image for the fast step (``DecoderState.fast``)."""

    projected: Tensor  # (B, A, L), 2(W_a a_i + b): σ(2u) takes 2u, locations last
    exp_projected: Tensor | None  # e^{-projected} for the compiled soft step
    gate_table: Tensor | None  # (K, 4n), E W_ih[:, :m]^T + b_ih + b_hh


def _kernels_as_built(
    method: Callable[Concatenate[FastBackend, P], R],
) -> Callable[Concatenate[FastBackend, P], R]:
    """``method`` with the compiled kernels enabled as the backend was built (``native``); the
    autograd functions it runs keep that for their backward."""

    @functools.wraps(method)
    def as_built(backend: FastBackend, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with native.enabled(backend.native):
            return method(backend, *args, **kwargs)

    return as_built


class FastBackend:
    """Chosen once when the model is built (``ShowAttendTell(config, backend="fast")``);
    ``native``: whether its passes may run the compiled kernels (False: the ``fused`` backend)."""

    def __init__(self, native: bool = True) -> None:
        self.native = native
        self.calls = 0  # passes and steps this backend computed (tests spy on it)
        # decoding's gate table with copies of the weights it was computed from
        self._gate_table: tuple[tuple[Tensor, ...], Tensor] | None = None

    def fits(self, model: ShowAttendTell) -> bool:
        """Whether ``model`` is made of exactly the stock modules and equations this backend
        computes: a replaced or subclassed attention, cell or layer runs the readable code."""
        stock = decoder.HardAttention if model.config.attention == "hard" else decoder.SoftAttention
        cls = type(model)
        return (
            type(model.attention) is stock
            and type(model.lstm) is nn.LSTMCell
            and type(model.embedding) is nn.Embedding
            and all(type(getattr(model, name)) is nn.Linear for name in _LINEARS)
            and (model.gate is None or type(model.gate) is nn.Linear)
            and type(model.dropout) is nn.Dropout
            and type(model.input_dropout) is nn.Dropout
            and all(getattr(cls, f) is getattr(ShowAttendTell, f) for f in _EQUATIONS)
        )

    # ------------------------------------------------------------------ training
    @_kernels_as_built
    def forward(
        self,
        model: ShowAttendTell,
        annotations: Tensor,
        inputs: Tensor,
        mode: str,
        locations: Tensor | None,
        rows_per_image: int,
    ) -> ForwardOutput | None:
        """``ShowAttendTell.forward`` through ``fused.recurrence``; None where it does not apply
        (off the CPU; autocast, whose casts are per op; decoding's sampled or argmax paths)."""
        if annotations.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
            return None
        hard_model = model.config.attention == "hard"
        if not (mode in ("train", "expected") or (hard_model and locations is not None)):
            return None
        if not hard_model and locations is not None:
            raise ValueError("locations can only be forced for hard attention")
        self.calls += 1
        B = inputs.size(0)
        hard, sampled = None, None
        if hard_model:
            use_expected = model.semi_sampling_mask(B, mode, locations, annotations.device)
            if use_expected is not None:
                sampled = ~use_expected
            else:  # mode "expected": α's expected context for every image, as at test time
                use_expected = torch.ones(B, dtype=torch.bool, device=annotations.device)
            hard = HardPath(use_expected, None if locations is None else locations.t())
        a = model.prepare(annotations)  # (B, L, D)
        mean, projected = a.mean(dim=1), _fast_projected(model, a)  # (B, D), (B, A, L)
        if rows_per_image > 1:
            a, mean, projected = (
                t.repeat_interleave(rows_per_image, 0) for t in (a, mean, projected)
            )
        embedded = model.embedding(inputs)  # (B, T, m)
        m, lstm, gate, att = model.config.embed_dim, model.lstm, model.gate, model.attention
        out = recurrence(
            projected,
            a,
            torch.tanh(model.init_h(mean)),
            torch.tanh(model.init_c(mean)),
            _embedding_gates(model, embedded),
            hidden_weight=att.hidden_proj.weight,
            score_weight=att.score.weight,
            gate_weight=None if gate is None else gate.weight,
            gate_bias=None if gate is None else gate.bias,
            weight_z=lstm.weight_ih[:, m:],
            weight_h=lstm.weight_hh,
            hard=hard,
        )
        hidden, context = out.hidden.transpose(0, 1), out.context.transpose(0, 1)  # (B, T, ·)
        return ForwardOutput(
            logits=_deep_output(model, embedded, hidden, context),  # (B, T, K)
            alphas=out.alphas.transpose(0, 1),  # (B, T, L)
            betas=out.betas.transpose(0, 1),  # (B, T)
            # none where nothing was sampled, as the readable loop gives
            location_log_probs=None if sampled is None else _transposed(out.location_log_probs),
            entropy=_transposed(out.entropy),  # (B, T)
            sampled=sampled,
        )

    # ------------------------------------------------------------------ decoding
    @_kernels_as_built
    def init_state(self, model: ShowAttendTell, state: DecoderState) -> DecoderState:
        """The readable state, plus for decoding without autograd what the fast step keeps."""
        if (
            state.annotations.device.type != "cpu"
            or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu")
        ):
            return state
        projected = 2.0 * state.projected.transpose(1, 2).contiguous()  # (B, A, L)
        exp_projected = None
        if model.config.attention == "soft":
            exp_projected = native.exp_of_projected(projected)
        table = self._embedding_gate_table(model)
        return dataclasses.replace(state, fast=FastState(projected, exp_projected, table))

    @_kernels_as_built
    def step(
        self, model: ShowAttendTell, prev_tokens: Tensor, state: DecoderState, mode: str
    ) -> StepOutput | None:
        """``ShowAttendTell.step`` for decoding's "expected" mode without autograd."""
        fast = state.fast
        if mode != "expected" or not isinstance(fast, FastState) or torch.is_grad_enabled():
            return None
        self.calls += 1
        a, h = state.annotations, state.h
        att = model.attention
        embedded = model.embedding(prev_tokens)  # (B, m)
        entropy, attended = None, None
        if model.config.attention == "soft" and native.available(a, fast.projected, h):
            attended = _attend_natively(model, a, fast.projected, h, fast.exp_projected)
        if attended is not None:
            alpha, context = attended
        else:
            query = 2.0 * att.hidden_proj(h)  # (B*k, A)
            weight = att.score.weight.to(query.dtype)
            scores = FusedScores.apply(fast.projected.to(query.dtype), query, weight, None)
            if model.config.attention == "hard":
                log_alpha = torch.log_softmax(scores, dim=-1)  # (B*k, L), Eq. 5
                alpha = log_alpha.exp()
                entropy = -(alpha * log_alpha).sum(-1)  # (B*k,)
            else:
                alpha = torch.softmax(scores, dim=-1)  # (B*k, L), Eq. 5
            context = decoder.expected_context(a, alpha)  # (B*k, D)
        if model.gate is not None:
            beta = torch.sigmoid(model.gate(h)).squeeze(1)  # (B*k,)
            context = beta.unsqueeze(1) * context
        else:
            beta = context.new_ones(context.size(0))
        h, c = self._lstm(model, prev_tokens, embedded, context, state, fast.gate_table)
        new_state = dataclasses.replace(state, h=h, c=c)
        logits = _deep_output(model, embedded, h, context)  # (B*k, K)
        return StepOutput(logits, alpha, new_state, beta, None, entropy)

    def _lstm(
        self,
        model: ShowAttendTell,
        prev_tokens: Tensor,
        embedded: Tensor,
        z: Tensor,
        state: DecoderState,
        table: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """Eq. 1-3 for decoding: from the table's rows where there is one, else through the
        BLAS and the compiled kernel, oneDNN, or ``nn.LSTMCell``; the same gates (i, f, g, o)."""
        lstm, m, h, c = model.lstm, model.config.embed_dim, state.h, state.c
        rows = prev_tokens.size(0)
        if table is not None and not _onednn_rows(rows):
            gates = table.index_select(0, prev_tokens)  # (rows, 4n)
            return _lstm_from_gates(gates, lstm.weight_ih[:, m:].t(), lstm.weight_hh.t(), z, h, c)
        x = torch.cat([embedded, z], dim=1)  # (rows, m + D)
        if not _onednn_rows(rows) and native.available(x, h, c):
            return _blas_lstm_step(lstm, x, h, c)
        if rows >= ONEDNN_LSTM_MIN_ROWS:
            return torch_lstm_step(lstm, x, h, c)
        h, c = lstm(x, (h, c))
        return h, c

    def _embedding_gate_table(self, model: ShowAttendTell) -> Tensor | None:
        """E W_ih[:, :m]^T + b_ih + b_hh (K, 4n), the embedding's share of Eq. 1 for every word.
        Kept with copies of what it was computed from and computed again unless these equal the
        parameters now: exactly, since an optimiser step need not bump a parameter's version
        counter (fused Adam does not). None beyond ``GATE_TABLE_MAX_ELEMENTS``."""
        lstm, K, m = model.lstm, model.config.vocab_size, model.config.embed_dim
        if K * lstm.weight_ih.size(0) > GATE_TABLE_MAX_ELEMENTS:
            return None
        sources = (model.embedding.weight, lstm.weight_ih[:, :m], lstm.bias_ih, lstm.bias_hh)
        cached = self._gate_table
        if cached is not None and _equal(cached[0], sources):
            return cached[1]
        table = torch.addmm(lstm.bias_ih + lstm.bias_hh, sources[0], sources[1].t())
        self._gate_table = (tuple(t.detach().clone() for t in sources), table)
        return table


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``nn.Dropout``'s distribution (kept with probability 1 - p, scaled by 1 / (1 - p)), drawn
    as a uniform compared with p, faster than torch's ``bernoulli_`` (docs/EXPERIMENTS.md)."""
    if not training or p == 0.0:
        return torch.nn.functional.dropout(x, p, training)
    keep = (torch.rand_like(x) >= p).to(x.dtype)
    return x * keep.mul_(1.0 / (1.0 - p))


def _deep_output(model: ShowAttendTell, embedded: Tensor, hidden: Tensor, z: Tensor) -> Tensor:
    """``ShowAttendTell.deep_output`` (Eq. 7) with this module's dropout."""
    pre = embedded + model.hidden_out(hidden) + model.context_out(z)  # (…, m)
    logits: Tensor = model.out(dropout(torch.tanh(pre), model.dropout.p, model.training))
    return logits  # (…, K)


def _fast_projected(model: ShowAttendTell, annotations: Tensor) -> Tensor:
    """2(W_a a_i + b) locations last, (B, L, D) -> (B, A, L): every elementwise pass of the
    scores then runs along L contiguous values, and the factor 2 of σ(2u) is paid once."""
    return 2.0 * model.attention.project(annotations).transpose(1, 2).contiguous()


def _embedding_gates(model: ShowAttendTell, embedded: Tensor) -> Tensor:
    """The embedding's share of Eq. 1 with both biases, (B, T, m) -> (T, B, 4n), one product
    for all T steps; ``input_dropout`` masks E y_{t-1} here (no draw when it is off)."""
    if model.config.input_dropout > 0:
        embedded = dropout(embedded, model.config.input_dropout, model.training)
    B, T, m = embedded.shape
    lstm = model.lstm
    return torch.addmm(
        lstm.bias_ih + lstm.bias_hh,
        embedded.transpose(0, 1).reshape(T * B, m),
        lstm.weight_ih[:, :m].t(),
    ).view(T, B, -1)


def _attend_natively(
    model: ShowAttendTell,
    annotations: Tensor,
    projected: Tensor,
    hidden: Tensor,
    exp_projected: Tensor | None,
) -> tuple[Tensor, Tensor] | None:
    """α (B*k, L) and Σ_i α_i a_i (B*k, D) in one compiled pass; None where it cannot run."""
    att = model.attention
    query = 2.0 * att.hidden_proj(hidden)  # (B*k, A)
    alpha = query.new_empty(query.size(0), projected.size(2))
    context = query.new_empty(query.size(0), annotations.size(2))
    if not native.attend_forward(
        projected, query, att.score.weight, annotations, alpha, context, exp_projected
    ):
        return None
    return alpha, context


def _fast_blas() -> bool:
    """Whether MKL's sgemm takes its fast code path here: on Intel CPUs."""
    return native.cpu_vendor() == "GenuineIntel"


def _onednn_rows(rows: int) -> bool:
    """Whether a CPU decoding step of ``rows`` rows goes to oneDNN (``torch_lstm_step``)."""
    return rows >= ONEDNN_LSTM_MIN_ROWS and not _fast_blas()


def _lstm_from_gates(
    gates: Tensor, weight_z: Tensor, weight_h: Tensor, z: Tensor, h: Tensor, c: Tensor
) -> tuple[Tensor, Tensor]:
    """Eq. 1-3 as ``nn.LSTMCell`` computes them from the embedding's share of the gates (rows,
    4n) and the transposed weights for ẑ_t (D, 4n) and h_{t-1} (n, 4n): (rows, n) x 2."""
    if native.available(gates, z, h, c):
        gates = gates.addmm_(z, weight_z).addmm_(h, weight_h)  # (rows, 4n), this step's own
        h_next, c_next = torch.empty_like(h), torch.empty_like(c)
        if native.lstm_forward(gates, c, c_next, h_next, None):
            return h_next, c_next
    gates = torch.addmm(torch.addmm(gates, z, weight_z), h, weight_h)  # (rows, 4n)
    n = h.size(1)
    i, f, _, o = torch.sigmoid(gates).chunk(4, dim=1)
    c = f * c + i * torch.tanh(gates[:, 2 * n : 3 * n])
    return o * torch.tanh(c), c


def _blas_lstm_step(cell: nn.LSTMCell, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``cell(x, (h, c))`` as two BLAS products and the compiled kernel of Eq. 2-3."""
    gates = torch.addmm(cell.bias_ih, x, cell.weight_ih.t()).add_(cell.bias_hh)  # (rows, 4n)
    gates.addmm_(h, cell.weight_hh.t())
    h_next, c_next = torch.empty_like(h), torch.empty_like(c)
    if not native.lstm_forward(gates, c, c_next, h_next, None):  # callers check availability
        raise RuntimeError("the compiled LSTM kernel did not run on available tensors")
    return h_next, c_next


def torch_lstm_step(cell: nn.LSTMCell, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``cell(x, (h, c))`` by ``torch.lstm`` (oneDNN's RNN primitive on CPU) over a one-step
    sequence with the cell's own weights: (rows, input), (rows, n) x 2 -> (rows, n) x 2."""
    weights = [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]
    hx = (h.unsqueeze(0), c.unsqueeze(0))  # (layers = 1, rows, n)
    # has_biases, num_layers, dropout, train, bidirectional, batch_first
    _, h, c = torch.lstm(x.unsqueeze(0), hx, weights, True, 1, 0.0, False, False, False)
    return h[0], c[0]


def _equal(kept: tuple[Tensor, ...], now: tuple[Tensor, ...]) -> bool:
    return all(
        a.shape == b.shape and a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(kept, now, strict=True)
    )


def _transposed(steps: Tensor | None) -> Tensor | None:
    return None if steps is None else steps.transpose(0, 1)  # (T, B) -> (B, T)
