"""The Show, Attend and Tell decoder (Xu et al. 2015, docs/METHOD.md).

Attention MLP ``f_att`` (Eq. 4-5), soft (Sec. 4.2) and hard (Sec. 4.1, Eq. 8-9) context vectors,
the gating scalar β (Sec. 4.2.1), the LSTM (Eq. 1-3) and the deep output layer (Eq. 7).

Dimensions, named once (docs/METHOD.md): ``B`` batch, ``T`` caption steps, ``L`` annotation
locations, ``D`` annotation size, ``m`` embedding size, ``n`` LSTM size, ``A`` attention-MLP
size, ``K`` vocabulary size.

Step modes: ``"train"`` (hard attention samples s̃ ~ Multinoulli(α), with semi-sampling; soft
attention takes the expectation), ``"expected"`` (ẑ = β Σ α a, the authors' test-time default),
``"sample"`` (one sampled location, no semi-sampling) and ``"argmax"`` (the most attended
location).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sat_model.config import ATTENTION_KINDS
from sat_model.data.vocab import END_ID
from sat_model.model import native
from sat_model.model.fused import (
    CollectProjected,
    FusedScores,
    HardPath,
    ProjectedGradient,
    expected_context,
    gather_location,
    recurrence,
    sample_locations,
)

if TYPE_CHECKING:
    from sat_model.config import ModelParams

__all__ = [
    "GATE_TABLE_MAX_ELEMENTS",
    "MODES",
    "ONEDNN_LSTM_MIN_ROWS",
    "SEMI_SAMPLING_PER",
    "AttentionOutput",
    "DecoderState",
    "ForwardOutput",
    "HardAttention",
    "ModelConfig",
    "ShowAttendTell",
    "SoftAttention",
    "StepOutput",
    "build_model",
    "torch_lstm_step",
]

MODES = ("train", "expected", "sample", "argmax")
SEMI_SAMPLING_PER = ("image", "batch")
# Rows from which decoding on CPU runs the LSTM step through torch.lstm, which PyTorch hands to
# oneDNN's RNN primitive, rather than nn.LSTMCell, whose two matmuls go to the BLAS (MKL).
# On the 2-core AMD CI machine MKL's sgemm reaches ~170 GFLOP/s and oneDNN's ~365, but
# torch.lstm repacks the weights on every call (~0.1 ms at the default sizes, ~22 ms at the
# paper's): at the default sizes 192 rows (64 images x beam 3) take 0.41 ms against 0.81 ms,
# 24 rows break even; at the paper's 192 rows take 40 ms against 51 ms, ~100 rows break even.
# Training (autograd) always uses LSTMCell: oneDNN's backward repacks the weights again.
# On Intel CPUs MKL runs its fast code path: on the 2-core Xeon (AVX-512) 192 rows take 0.52 ms
# through torch.lstm against 0.39 ms as two BLAS products and the compiled LSTM kernel
# (native.lstm_forward), and at the paper's sizes 41 ms against 28 ms; there decoding always
# takes the BLAS and the kernel (``_blas_lstm_step``).
ONEDNN_LSTM_MIN_ROWS = 128
# Decoding takes the embedding's share of the LSTM's gates from a (K, 4n) table when it has at
# most this many elements (64 MB in float32; the Flickr8k profile's is ~6 M, the paper's 72 M).
GATE_TABLE_MAX_ELEMENTS = 16_000_000


def _fast_blas() -> bool:
    """Whether MKL's sgemm takes its fast code path here: on Intel CPUs (see above)."""
    return native.cpu_vendor() == "GenuineIntel"


def _onednn_rows(rows: int) -> bool:
    """Whether a CPU decoding step of ``rows`` rows goes to oneDNN (``torch_lstm_step``)
    rather than the BLAS products and the compiled kernel (see ``ONEDNN_LSTM_MIN_ROWS``)."""
    return rows >= ONEDNN_LSTM_MIN_ROWS and not _fast_blas()


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model; saved in checkpoints as JSON (``asdict``)."""

    vocab_size: int  # K, special tokens included
    annotation_dim: int  # D, fixed by the encoder's feature layer
    num_locations: int  # L, the encoder's grid (14 x 14 = 196 in the paper)
    embed_dim: int  # m
    hidden_dim: int  # n
    attention_dim: int  # A, hidden size of the attention MLP f_att (Eq. 4)
    dropout: float  # before L_o, as in the authors' code
    gate: bool  # gating scalar β_t (Sec. 4.2.1); False fixes β_t = 1
    attention: str  # "soft" (Sec. 4.2) or "hard" (Sec. 4.1)
    # hard attention only: chance of using α instead of s̃ while training (Sec. 4.1), drawn per
    # image (paper text) or once per minibatch (authors' code)
    semi_sampling_p: float = 0.5
    semi_sampling_per: str = "image"
    # beyond the paper: append each cell's (x, y) centre, in [-1, 1], to its annotation vector
    # (D -> D + 2), so that α and ẑ_t say *where* the model looks. Convolutional features are
    # translation-equivariant and carry almost no position, which captions that name objects left
    # to right and their relations ("above", "to the left of") need. Off in older checkpoints.
    coordinates: bool = False
    grid_w: int = 0  # columns of the row-major L = grid_h × grid_w grid (needed for coordinates)
    # standardise every channel of a_i with the training features' mean and std (buffers in the
    # state dict, set by set_feature_statistics): raw CNN activations have std ~5 and means up to
    # ~±8 per channel, which saturates σ/tanh in f_att and the LSTM at the default init
    normalize_features: bool = False
    # beyond the paper: dropout on E y_{t-1} where it enters the LSTM (Eq. 1), in training; the
    # deep output (Eq. 7) still sees the whole embedding. 0 (off) in older checkpoints
    input_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "annotation_dim", "num_locations", "embed_dim", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_dim < 1:
            raise ValueError(f"ModelConfig.attention_dim must be >= 1, got {self.attention_dim}")
        if self.vocab_size <= END_ID:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room for <pad>/<start>/<end>")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; expected {ATTENTION_KINDS}")
        for name in ("dropout", "input_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.semi_sampling_p <= 1.0:
            raise ValueError(f"semi_sampling_p must be in [0, 1], got {self.semi_sampling_p}")
        if self.coordinates and (self.grid_w < 1 or self.num_locations % self.grid_w):
            raise ValueError(
                f"coordinates need grid_w dividing num_locations={self.num_locations}, "
                f"got grid_w={self.grid_w}"
            )
        if self.semi_sampling_per not in SEMI_SAMPLING_PER:
            raise ValueError(
                f"unknown semi_sampling_per {self.semi_sampling_per!r}; "
                f"expected {SEMI_SAMPLING_PER}"
            )


@dataclass(frozen=True)
class AttentionOutput:
    alpha: Tensor  # (B, L), Eq. 5
    context: Tensor  # (B, D), φ before the gate β
    location_log_prob: Tensor | None = None  # (B,) log p(s̃_t | a), hard attention only
    entropy: Tensor | None = None  # (B,) H[α_t], hard attention only


@dataclass(frozen=True)
class DecoderState:
    """LSTM state plus the per-image tensors that do not change over the caption.

    The LSTM state has ``k`` rows per image, consecutive (``k`` = 1 in training and at beam
    search's first step, then the beam size); the per-image tensors are held once per image and
    shared by its rows.
    """

    h: Tensor  # (B*k, n)
    c: Tensor  # (B*k, n)
    annotations: Tensor  # (B, L, D)
    projected: Tensor  # (B, A, L), 2(W_a a_i + b) (Eq. 4, scaled for σ(2u)), once per image
    # where the steps' backward passes add up the gradient for ``projected`` (training only)
    projected_grad: ProjectedGradient | None = None
    # e^{-projected} for the decoding kernel (``native.exp_of_projected``), once per image
    exp_projected: Tensor | None = None
    # decoding's embedding share of the LSTM's gates for every word (K, 4n), once per call
    gate_table: Tensor | None = None

    def reorder(self, index: Tensor) -> DecoderState:
        """Select rows of the LSTM state (beam search: each image's one row to its first k
        continuations, then the surviving beams). A beam only moves within its image, so the
        per-image tensors stay in place rather than being copied every step."""
        return dataclasses.replace(self, h=self.h[index], c=self.c[index])


@dataclass(frozen=True)
class StepOutput:
    logits: Tensor  # (B, K), Eq. 7 before the softmax
    alpha: Tensor  # (B, L)
    state: DecoderState
    beta: Tensor | None = None  # (B,)
    location_log_prob: Tensor | None = None  # (B,)
    entropy: Tensor | None = None  # (B,)


@dataclass(frozen=True)
class ForwardOutput:
    logits: Tensor  # (B, T, K)
    alphas: Tensor  # (B, T, L)
    betas: Tensor  # (B, T)
    location_log_probs: Tensor | None = None  # (B, T), hard attention in train/sample mode
    entropy: Tensor | None = None  # (B, T), hard attention
    # (B,) bool, True where s̃ was sampled; False where semi-sampling used α (no REINFORCE term)
    sampled: Tensor | None = None


class SoftAttention(nn.Module):
    """``f_att`` (Eq. 4-5) and the expected context Σ_i α_i a_i (Sec. 4.2)."""

    def __init__(self, annotation_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.annotation_proj = nn.Linear(annotation_dim, attention_dim)  # W_a, b
        self.hidden_proj = nn.Linear(hidden_dim, attention_dim, bias=False)  # W_h
        # a bias on w_att would cancel in the softmax (Eq. 5)
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w_att

    def project(self, annotations: Tensor) -> Tensor:
        """2(W_a a_i + b) for every location: (B, L, D) -> (B, A, L), once per image; the factor
        2 is that of σ(2u) in ``scores``, paid here once rather than on every step. Locations
        last: every elementwise pass of ``scores`` then runs along L (196) contiguous values
        rather than A (32 at the default sizes), ~1.3x faster on the step's largest tensor."""
        projected: Tensor = self.annotation_proj(annotations)  # (B, L, A)
        return 2.0 * projected.transpose(1, 2).contiguous()

    def scores(
        self, projected: Tensor, hidden: Tensor, sink: ProjectedGradient | None = None
    ) -> Tensor:
        """e_ti (Eq. 4) up to a shift that is the same at every location: (B*k, L), for
        ``projected`` (B, A, L) from ``project`` and ``hidden`` (B*k, n) with k rows per image.

        tanh(u) = 2σ(2u) - 1, so w_att^T tanh(u) = 2 w_att^T σ(2u) - Σ w_att: the last term is
        the same for every i and cancels in the softmax of Eq. 5, so α is exactly Eq. 4-5's.
        σ, because the pinned torch's CPU tanh ran 5-9x slower than its sigmoid on this, the
        step's largest tensor, on the 2-core CI machine (benchmarks/bench_model.py,
        "attention_nonlinearity"; builds where tanh is the faster one lose little).
        The (B*k, A, L) tensor is never held whole: ``FusedScores`` works through it a few
        images at a time and its backward recomputes σ; ``sink`` (from ``init_state``) collects
        the gradient for ``projected`` over all steps.
        """
        hidden = 2.0 * self.hidden_proj(hidden)  # (B*k, A)
        # under autocast the projections come out in its lower precision while w_att stays in
        # the parameters' dtype: the fused function runs in the projections' dtype, as autocast
        # would run the unfused add, tanh and product; autograd casts w_att's gradient back
        weight = self.score.weight.to(hidden.dtype)
        scores: Tensor = FusedScores.apply(projected.to(hidden.dtype), hidden, weight, sink)
        return scores  # (B*k, L)

    def forward(
        self,
        annotations: Tensor,
        projected: Tensor,
        hidden: Tensor,
        mode: str = "expected",
        sink: ProjectedGradient | None = None,
        exp_projected: Tensor | None = None,
    ) -> AttentionOutput:
        """``exp_projected``: ``DecoderState.exp_projected``, for the decoding kernel."""
        decoding = mode == "expected" and not torch.is_grad_enabled()
        if decoding and native.available(annotations, projected, hidden):  # one kernel a step
            attended = self._attend_natively(annotations, projected, hidden, exp_projected)
            if attended is not None:
                return attended
        alpha = torch.softmax(self.scores(projected, hidden, sink), dim=-1)  # (B, L), Eq. 5
        if mode in ("train", "expected"):
            return AttentionOutput(alpha=alpha, context=expected_context(annotations, alpha))
        location = _pick_location(alpha, mode)
        return AttentionOutput(alpha=alpha, context=gather_location(annotations, location))

    def _attend_natively(
        self,
        annotations: Tensor,
        projected: Tensor,
        hidden: Tensor,
        exp_projected: Tensor | None = None,
    ) -> AttentionOutput | None:
        """α and Σ_i α_i a_i through ``native.attend_forward``: the scores, the softmax and
        the expected context of the k rows of each image in one pass; None where the kernels
        cannot run (then ``forward`` computes the same in PyTorch's ops)."""
        query = 2.0 * self.hidden_proj(hidden)  # (B*k, A)
        rows, D = query.size(0), annotations.size(2)
        alpha = query.new_empty(rows, projected.size(2))
        context = query.new_empty(rows, D)
        if not native.attend_forward(
            projected, query, self.score.weight, annotations, alpha, context, exp_projected
        ):
            return None
        return AttentionOutput(alpha=alpha, context=context)


class HardAttention(SoftAttention):
    """Stochastic attention (Sec. 4.1): ẑ_t = a at s̃_t ~ Multinoulli(α_t) (Eq. 8-9)."""

    def forward(  # type: ignore[override]
        self,
        annotations: Tensor,
        projected: Tensor,
        hidden: Tensor,
        mode: str = "expected",
        use_expected: Tensor | None = None,
        location: Tensor | None = None,
        sink: ProjectedGradient | None = None,
    ) -> AttentionOutput:
        """``use_expected`` (B,) bool: semi-sampling, α instead of s̃ for those images.
        ``location`` (B,) long forces s̃_t (exact enumeration of Eq. 10)."""
        log_alpha = torch.log_softmax(self.scores(projected, hidden, sink), dim=-1)  # (B, L)
        alpha = log_alpha.exp()
        entropy = -(alpha * log_alpha).sum(-1)  # (B,) H[α_t], the entropy term of Sec. 4.1
        if mode == "expected" and location is None:
            context = expected_context(annotations, alpha)
            return AttentionOutput(alpha=alpha, context=context, entropy=entropy)
        if location is None:
            location = _pick_location(alpha, mode)
        context = gather_location(annotations, location)  # (B, D), Eq. 9
        if use_expected is not None:
            expected = expected_context(annotations, alpha)
            context = torch.where(use_expected.unsqueeze(1), expected, context)
        log_prob = log_alpha.gather(1, location.unsqueeze(1)).squeeze(1)  # (B,) log α_{t,s̃}
        return AttentionOutput(alpha, context, location_log_prob=log_prob, entropy=entropy)


def _pick_location(alpha: Tensor, mode: str) -> Tensor:
    """s̃_t as an index (B,): a sample of Multinoulli(α) (Eq. 8), or the argmax."""
    if mode == "argmax":
        return alpha.argmax(-1)
    if mode in ("train", "sample"):
        return sample_locations(alpha)
    raise ValueError(f"unknown attention mode {mode!r}; expected one of {MODES}")


class Dropout(nn.Dropout):
    """``nn.Dropout``'s distribution, each value kept with probability 1 - p and scaled by
    1 / (1 - p), drawn on CPU as a uniform compared with p: the pinned torch's CPU
    ``bernoulli_`` took 1.6 ms for the deep output's (64, 20, 96) against 0.5 ms this way.
    Other devices keep torch's own fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        keep = (torch.rand_like(x) >= self.p).to(x.dtype)
        return x * keep.mul_(1.0 / (1.0 - self.p))


@dataclass(frozen=True)
class _Advance:
    """One recurrence step before the output layer."""

    state: DecoderState
    context: Tensor  # (B, D), ẑ_t = β_t φ(...)
    attention: AttentionOutput
    beta: Tensor  # (B,)


class ShowAttendTell(nn.Module):
    """The decoder of Sec. 3.1.2 with soft or hard attention, over precomputed annotations."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        D, m, n, K = config.annotation_dim, config.embed_dim, config.hidden_dim, config.vocab_size
        if config.normalize_features:
            self.register_buffer("feature_mean", torch.zeros(D))
            self.register_buffer("feature_std", torch.ones(D))
        else:
            self.feature_mean = self.feature_std = None
        if config.coordinates:
            # derived from the config, so not part of the state dict
            self.register_buffer("coords", _cell_coordinates(config), persistent=False)
            D += 2
        else:
            self.coords = None
        self.embedding = nn.Embedding(K, m)  # E
        attention_cls = HardAttention if config.attention == "hard" else SoftAttention
        self.attention = attention_cls(D, n, config.attention_dim)
        # h_0, c_0 from the mean annotation through two MLPs (Sec. 3.1.2); tanh as in the code
        self.init_h = nn.Linear(D, n)
        self.init_c = nn.Linear(D, n)
        self.gate = nn.Linear(n, 1) if config.gate else None  # f_β (Sec. 4.2.1)
        # [E y_{t-1}; ẑ_t] with h_{t-1}: T_{m+n+D,4n} of Eq. 1
        self.lstm = nn.LSTMCell(m + D, n)
        self.hidden_out = nn.Linear(n, m, bias=False)  # L_h (Eq. 7)
        self.context_out = nn.Linear(D, m, bias=False)  # L_z (Eq. 7)
        self.dropout = Dropout(config.dropout)
        self.input_dropout = Dropout(config.input_dropout)
        self.out = nn.Linear(m, K)  # L_o (Eq. 7)
        # decoding's embedding share of Eq. 1 over the vocabulary, with what it was computed
        # from (``_embedding_gate_table``); not part of the state dict
        self._gate_table: tuple[tuple[Tensor, ...], Tensor] | None = None

    @torch.no_grad()
    def set_feature_statistics(self, mean: Tensor, std: Tensor) -> None:
        """The per-channel mean and std (D,) of the training features (``normalize_features``)."""
        if self.feature_mean is None or self.feature_std is None:
            raise RuntimeError("this model was built with normalize_features=False")
        D = self.config.annotation_dim
        if tuple(mean.shape) != (D,) or tuple(std.shape) != (D,):
            raise ValueError(f"statistics must have shape ({D},), got {tuple(mean.shape)}")
        self.feature_mean.copy_(mean)
        # a constant channel (std 0) is only centred, not blown up
        self.feature_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def init_state(self, annotations: Tensor, rows_per_image: int = 1) -> DecoderState:
        """h_0, c_0 (Sec. 3.1.2) and W_a a, computed once per image (and repeated for
        ``forward``'s ``rows_per_image``); without autograd, for soft attention's decoding
        kernel, also e^{-W_a a} (``native.exp_of_projected``), and for the decoding steps the
        embedding's share of the gates (``_embedding_gate_table``)."""
        annotations, mean, projected = self._prepare(annotations, rows_per_image)
        sink, exp_projected = None, None
        if projected.requires_grad:
            sink = ProjectedGradient()
            projected = CollectProjected.apply(projected, sink)
        elif not isinstance(self.attention, HardAttention) and not torch.is_grad_enabled():
            exp_projected = native.exp_of_projected(projected)
        h, c = self._initial_state(mean)
        return DecoderState(
            h=h,
            c=c,
            annotations=annotations,
            projected=projected,
            projected_grad=sink,
            exp_projected=exp_projected,
            gate_table=self._embedding_gate_table(annotations.device),
        )

    def _initial_state(self, mean: Tensor) -> tuple[Tensor, Tensor]:
        """h_0, c_0 (B, n) from the mean annotation (B, D): two MLPs, tanh as in the code
        (Sec. 3.1.2)."""
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def _embedding_gates(self, embedded: Tensor) -> Tensor:
        """The embedding's share of Eq. 1 with both biases, (B, T, m) -> (T, B, 4n): it does
        not depend on the recurrence, so one product for all T steps; the shares of ẑ_t and
        h_{t-1} stay in the steps. ``input_dropout``, when on, masks E y_{t-1} here, on its
        way into the LSTM only (no random draw when it is off, so runs without it keep their
        random streams)."""
        if self.config.input_dropout > 0:
            embedded = self.input_dropout(embedded)
        B, T, m = embedded.shape
        lstm = self.lstm
        return torch.addmm(
            lstm.bias_ih + lstm.bias_hh,
            embedded.transpose(0, 1).reshape(T * B, m),
            lstm.weight_ih[:, :m].t(),
        ).view(T, B, -1)

    def _prepare(
        self, annotations: Tensor, rows_per_image: int = 1
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The annotations attended over (B, L, D): standardised, with cell coordinates; their
        mean over locations (B, D); and ``SoftAttention.project``'s W_a a (B, A, L); each
        computed once per image and then repeated for its ``rows_per_image`` captions
        (B*k first dimensions; autograd adds their gradients up over the k)."""
        self._check_annotations(annotations)
        if self.feature_mean is not None:
            annotations = (annotations - self.feature_mean) / self.feature_std  # (B, L, D)
        if self.coords is not None:
            coords = self.coords.to(annotations.dtype).expand(annotations.size(0), -1, -1)
            annotations = torch.cat([annotations, coords], dim=2)  # (B, L, D + 2)
        prepared = (annotations, annotations.mean(dim=1), self.attention.project(annotations))
        if rows_per_image == 1:
            return prepared
        repeated = (t.repeat_interleave(rows_per_image, dim=0) for t in prepared)
        annotations, mean, projected = repeated
        return annotations, mean, projected

    def forward(
        self,
        annotations: Tensor,
        captions: Tensor,
        *,
        mode: str | None = None,
        locations: Tensor | None = None,
        rows_per_image: int = 1,
    ) -> ForwardOutput:
        """Teacher-forced pass: inputs ``captions[:, :-1]`` (B, T), one step per input token.

        ``mode`` defaults to "train" in training mode and "expected" in eval mode.
        ``locations`` (B, T) forces the hard-attention path s̃ (no semi-sampling).
        ``rows_per_image`` k: ``annotations`` holds B/k images, each for k consecutive captions
        (self-critical training's samples); what depends on the image alone is computed once.
        """
        mode = mode or ("train" if self.training else "expected")
        _check_mode(mode)
        inputs = captions[:, :-1]  # (B, T)
        if rows_per_image < 1 or annotations.size(0) * rows_per_image != inputs.size(0):
            raise ValueError(
                f"{inputs.size(0)} captions for {annotations.size(0)} images at "
                f"rows_per_image={rows_per_image}"
            )
        if self._fused_pass(annotations, mode, locations):
            return self._fused_forward(annotations, inputs, mode, locations, rows_per_image)
        B, T = inputs.shape
        state = self.init_state(annotations, rows_per_image)
        embedded = self.embedding(inputs)  # (B, T, m)
        use_expected = self._semi_sampling_mask(B, mode, locations, annotations.device)
        m = self.config.embed_dim
        weights = (self.lstm.weight_ih[:, m:].t(), self.lstm.weight_hh.t())  # (D, 4n), (n, 4n)
        # unbind, not input_gates[t]: the backward of one unbind is one stack, where each of T
        # selects would zero-fill and add a whole (T, B, 4n) gradient
        gates_per_step = self._embedding_gates(embedded).unbind(0)  # T x (B, 4n)
        steps = []
        for t in range(T):
            location = None if locations is None else locations[:, t]
            lstm_inputs = (gates_per_step[t], *weights)
            step = self._advance(embedded[:, t], state, mode, use_expected, location, lstm_inputs)
            state = step.state
            steps.append(step)
        hidden = torch.stack([s.state.h for s in steps], dim=1)  # (B, T, n)
        context = torch.stack([s.context for s in steps], dim=1)  # (B, T, D)
        # the output layer runs once over all steps rather than T times
        return ForwardOutput(
            logits=self._deep_output(embedded, hidden, context),  # (B, T, K)
            alphas=torch.stack([s.attention.alpha for s in steps], dim=1),  # (B, T, L)
            betas=torch.stack([s.beta for s in steps], dim=1),  # (B, T)
            location_log_probs=_stack_optional([s.attention.location_log_prob for s in steps]),
            entropy=_stack_optional([s.attention.entropy for s in steps]),
            sampled=None if use_expected is None else ~use_expected,
        )

    def _fused_pass(self, annotations: Tensor, mode: str, locations: Tensor | None) -> bool:
        """Training passes take the fused recurrence: the expected context (soft attention, and
        hard attention's test-time path, which self-critical training fine-tunes), hard
        attention's sampled (or forced) path. Other modes (the sampled or argmax paths of
        decoding) and autocast (its casts are per op) take the step loop."""
        if torch.is_autocast_enabled(annotations.device.type):
            return False
        if isinstance(self.attention, HardAttention):
            return mode in ("train", "expected") or locations is not None
        return mode in ("train", "expected") and locations is None

    def _fused_forward(
        self,
        annotations: Tensor,
        inputs: Tensor,
        mode: str,
        locations: Tensor | None,
        rows_per_image: int = 1,
    ) -> ForwardOutput:
        """``forward`` through ``fused.recurrence``: the same numbers as the step loop up to
        float rounding (and the same draws of s̃), one autograd node for the T steps."""
        B = inputs.size(0)
        hard, sampled = None, None
        if isinstance(self.attention, HardAttention):
            use_expected = self._semi_sampling_mask(B, mode, locations, annotations.device)
            if use_expected is not None:
                sampled = ~use_expected
            else:  # mode "expected": α's expected context for every image, as at test time
                use_expected = torch.ones(B, dtype=torch.bool, device=annotations.device)
            hard = HardPath(use_expected, None if locations is None else locations.t())
        annotations, mean, projected = self._prepare(annotations, rows_per_image)
        embedded = self.embedding(inputs)  # (B, T, m)
        m, lstm = self.config.embed_dim, self.lstm
        out = recurrence(
            projected,
            annotations,
            *self._initial_state(mean),
            self._embedding_gates(embedded),
            hidden_weight=self.attention.hidden_proj.weight,
            score_weight=self.attention.score.weight,
            gate_weight=None if self.gate is None else self.gate.weight,
            gate_bias=None if self.gate is None else self.gate.bias,
            weight_z=lstm.weight_ih[:, m:],
            weight_h=lstm.weight_hh,
            hard=hard,
        )
        hidden, context = out.hidden.transpose(0, 1), out.context.transpose(0, 1)  # (B, T, ·)
        return ForwardOutput(
            logits=self._deep_output(embedded, hidden, context),  # (B, T, K)
            alphas=out.alphas.transpose(0, 1),  # (B, T, L)
            betas=out.betas.transpose(0, 1),  # (B, T)
            # (B, T); none where nothing was sampled, as the step loop gives
            location_log_probs=None if sampled is None else _transposed(out.location_log_probs),
            entropy=_transposed(out.entropy),  # (B, T)
            sampled=sampled,
        )

    def step(self, prev_tokens: Tensor, state: DecoderState, mode: str = "expected") -> StepOutput:
        """One decoding step from y_{t-1} (B,) and the state at t-1."""
        _check_mode(mode)
        embedded = self.embedding(prev_tokens)  # (B, m)
        lstm_inputs = self._decoding_lstm_inputs(prev_tokens, state.gate_table)
        adv = self._advance(embedded, state, mode, None, None, lstm_inputs)
        return StepOutput(
            logits=self._deep_output(embedded, adv.state.h, adv.context),  # (B, K)
            alpha=adv.attention.alpha,
            state=adv.state,
            beta=adv.beta,
            location_log_prob=adv.attention.location_log_prob,
            entropy=adv.attention.entropy,
        )

    def _advance(
        self,
        embedded: Tensor,
        state: DecoderState,
        mode: str,
        use_expected: Tensor | None,
        location: Tensor | None,
        lstm_inputs: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> _Advance:
        """Attention from h_{t-1} (Eq. 4-6), gate, then the LSTM (Eq. 1-3); ``lstm_inputs``
        (see ``_lstm_from_gates``) when the embedding's share of Eq. 1 is already computed."""
        if isinstance(self.attention, HardAttention):
            att = self.attention(
                state.annotations,
                state.projected,
                state.h,
                mode,
                use_expected,
                location,
                state.projected_grad,
            )
        else:
            att = self.attention(
                state.annotations,
                state.projected,
                state.h,
                mode,
                state.projected_grad,
                state.exp_projected,
            )
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(state.h)).squeeze(1)  # (B,), β_t = σ(f_β(h_{t-1}))
            context = beta.unsqueeze(1) * att.context  # (B, D)
        else:
            beta = att.context.new_ones(att.context.size(0))
            context = att.context
        if lstm_inputs is None:
            h, c = self._lstm(torch.cat([embedded, context], dim=1), state.h, state.c)
        else:
            h, c = _lstm_from_gates(*lstm_inputs, context, state.h, state.c)
        new_state = dataclasses.replace(state, h=h, c=c)
        return _Advance(state=new_state, context=context, attention=att, beta=beta)

    def _decoding_lstm_inputs(
        self, prev_tokens: Tensor, table: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The embedding's share of Eq. 1 as rows of ``DecoderState.gate_table``, for
        ``_lstm_from_gates``: the step's product then spans ẑ_t and h_{t-1} only (at the
        default sizes 306 of the 402 input columns). None without a table, or where ``_lstm``
        would hand the step to oneDNN (its RNN primitive takes the whole input)."""
        if table is None:
            return None
        if prev_tokens.device.type == "cpu" and _onednn_rows(prev_tokens.size(0)):
            return None
        m, lstm = self.config.embed_dim, self.lstm
        return table.index_select(0, prev_tokens), lstm.weight_ih[:, m:].t(), lstm.weight_hh.t()

    def _embedding_gate_table(self, device: torch.device) -> Tensor | None:
        """For decoding without autograd or autocast: E W_ih[:, :m]^T + b_ih + b_hh (K, 4n),
        the embedding's share of Eq. 1 for every word. Kept for the next decoding call with
        copies of what it was computed from, and computed again unless these are equal to the
        parameters now: exact comparison, because an optimiser step need not bump a
        parameter's version counter (fused Adam does not). None under autograd or autocast,
        or beyond ``GATE_TABLE_MAX_ELEMENTS`` (the paper's K × 4n is 72 M)."""
        if torch.is_grad_enabled() or torch.is_autocast_enabled(device.type):
            return None
        lstm, K, m = self.lstm, self.config.vocab_size, self.config.embed_dim
        if K * lstm.weight_ih.size(0) > GATE_TABLE_MAX_ELEMENTS:
            return None
        sources = (self.embedding.weight, lstm.weight_ih[:, :m], lstm.bias_ih, lstm.bias_hh)
        cached = self._gate_table
        if cached is not None and _equal(cached[0], sources):
            return cached[1]
        table = torch.addmm(lstm.bias_ih + lstm.bias_hh, sources[0], sources[1].t())
        self._gate_table = (tuple(t.detach().clone() for t in sources), table)
        return table

    def _lstm(self, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        """Eq. 1-3, one step for (rows, m + D) inputs: ``nn.LSTMCell``, or without autograd on
        CPU the same weights as two BLAS products and the compiled kernel (``_blas_lstm_step``,
        where the kernels run: for few rows, or any number where MKL is fast) or through
        ``torch.lstm`` (oneDNN) for many rows (see ``ONEDNN_LSTM_MIN_ROWS``). All compute the
        same gates in the same order (i, f, g, o)."""
        if x.device.type == "cpu" and not torch.is_grad_enabled():
            rows = x.size(0)
            if not _onednn_rows(rows) and native.available(x, h, c):
                return _blas_lstm_step(self.lstm, x, h, c)
            if rows >= ONEDNN_LSTM_MIN_ROWS:
                return torch_lstm_step(self.lstm, x, h, c)
        h, c = self.lstm(x, (h, c))
        return h, c

    def _deep_output(self, embedded: Tensor, hidden: Tensor, context: Tensor) -> Tensor:
        """Eq. 7: L_o(E y_{t-1} + L_h h_t + L_z ẑ_t); tanh, dropout before L_o (authors' code)."""
        pre = embedded + self.hidden_out(hidden) + self.context_out(context)  # (…, m)
        logits: Tensor = self.out(self.dropout(torch.tanh(pre)))
        return logits  # (…, K)

    def _semi_sampling_mask(
        self, batch: int, mode: str, locations: Tensor | None, device: torch.device
    ) -> Tensor | None:
        """(B,) bool, True where α replaces s̃ (Sec. 4.1); None when nothing is sampled."""
        if self.config.attention != "hard":
            if locations is not None:
                raise ValueError("locations can only be forced for hard attention")
            return None
        if mode == "expected" and locations is None:
            return None
        if mode != "train" or locations is not None:
            return torch.zeros(batch, dtype=torch.bool, device=device)
        p = self.config.semi_sampling_p
        if self.config.semi_sampling_per == "batch":
            return (torch.rand((), device=device) < p).expand(batch)
        return torch.rand(batch, device=device) < p

    def _check_annotations(self, annotations: Tensor) -> None:
        expected = (self.config.num_locations, self.config.annotation_dim)
        if annotations.dim() != 3 or tuple(annotations.shape[1:]) != expected:
            raise ValueError(
                f"annotations must have shape (B, {expected[0]}, {expected[1]}), "
                f"got {tuple(annotations.shape)}"
            )


def _equal(kept: tuple[Tensor, ...], now: tuple[Tensor, ...]) -> bool:
    return all(
        a.shape == b.shape and a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(kept, now, strict=True)
    )


def _lstm_from_gates(
    gates: Tensor, weight_z: Tensor, weight_h: Tensor, z: Tensor, h: Tensor, c: Tensor
) -> tuple[Tensor, Tensor]:
    """Eq. 1-3 as ``nn.LSTMCell`` computes them (gates i, f, g, o), from the embedding's share
    of the gates with both biases (rows, 4n) and the transposed weights for ẑ_t (D, 4n) and
    h_{t-1} (n, 4n): (rows, n) x 2. Without autograd on CPU, Eq. 2-3 in the compiled kernel."""
    if not torch.is_grad_enabled() and native.available(gates, z, h, c):
        # ``gates`` is this step's own (rows of decoding's table, or ``forward``'s gates of
        # this step, each read once): added to in place
        gates = gates.addmm_(z, weight_z).addmm_(h, weight_h)  # (rows, 4n)
        h_next, c_next = torch.empty_like(h), torch.empty_like(c)
        if native.lstm_forward(gates, c, c_next, h_next, None):
            return h_next, c_next
    gates = torch.addmm(torch.addmm(gates, z, weight_z), h, weight_h)  # (rows, 4n)
    n = h.size(1)
    i, f, _, o = torch.sigmoid(gates).chunk(4, dim=1)
    c = f * c + i * torch.tanh(gates[:, 2 * n : 3 * n])
    return o * torch.tanh(c), c


def _blas_lstm_step(cell: nn.LSTMCell, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``cell(x, (h, c))`` without autograd as two BLAS products and the compiled kernel of
    Eq. 2-3 (``native.lstm_forward``), float32 on CPU: (rows, input), (rows, n) x 2."""
    gates = torch.addmm(cell.bias_ih, x, cell.weight_ih.t()).add_(cell.bias_hh)  # (rows, 4n)
    gates.addmm_(h, cell.weight_hh.t())
    h_next, c_next = torch.empty_like(h), torch.empty_like(c)
    if not native.lstm_forward(gates, c, c_next, h_next, None):  # callers check availability
        raise RuntimeError("the compiled LSTM kernel did not run on available tensors")
    return h_next, c_next


def torch_lstm_step(cell: nn.LSTMCell, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``cell(x, (h, c))`` computed by ``torch.lstm`` (oneDNN's RNN primitive on CPU) over a
    one-step sequence with the cell's own weights: (rows, input), (rows, n) x 2 -> (rows, n) x 2.
    """
    weights = [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]
    hx = (h.unsqueeze(0), c.unsqueeze(0))  # (layers = 1, rows, n)
    # has_biases, num_layers, dropout, train, bidirectional, batch_first
    _, h, c = torch.lstm(x.unsqueeze(0), hx, weights, True, 1, 0.0, False, False, False)
    return h[0], c[0]


def _cell_coordinates(config: ModelConfig) -> Tensor:
    """(x, y) of every cell centre in [-1, 1], row-major as the feature map is flattened: (L, 2)."""
    grid_h, grid_w = config.num_locations // config.grid_w, config.grid_w
    ys = (torch.arange(grid_h, dtype=torch.float32) + 0.5) / grid_h * 2 - 1  # (grid_h,)
    xs = (torch.arange(grid_w, dtype=torch.float32) + 0.5) / grid_w * 2 - 1  # (grid_w,)
    y, x = torch.meshgrid(ys, xs, indexing="ij")  # (grid_h, grid_w) each
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # (L, 2)


def _transposed(steps: Tensor | None) -> Tensor | None:
    return None if steps is None else steps.transpose(0, 1)  # (T, B) -> (B, T)


def _stack_optional(values: list[Tensor | None]) -> Tensor | None:
    return None if values[0] is None else torch.stack(values, dim=1)  # type: ignore[arg-type]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


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

    ``semi_sampling_p``/``semi_sampling_per`` come from ``params.train.hard`` (ignored for soft).
    ``grid_w`` is the feature grid's width; None means a square grid (the encoders' crops are).
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
    config = ModelConfig(
        vocab_size=vocab_size,
        annotation_dim=annotation_dim,
        num_locations=num_locations,
        embed_dim=model_params.embed_dim,
        hidden_dim=model_params.hidden_dim,
        attention_dim=model_params.attention_dim,
        dropout=model_params.dropout,
        input_dropout=model_params.input_dropout,
        gate=model_params.gate,
        attention=attention,
        semi_sampling_p=semi_sampling_p,
        semi_sampling_per=semi_sampling_per,
        coordinates=model_params.coordinates,
        normalize_features=model_params.normalize_features,
        grid_w=grid_w if grid_w is not None else math.isqrt(num_locations),
    )
    return ShowAttendTell(config)
