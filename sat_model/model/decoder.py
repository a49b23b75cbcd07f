"""The Show, Attend and Tell decoder (Xu et al. 2015), equation by equation as docs/METHOD.md.

Read top to bottom: ``f_att`` and α (Eq. 4-5), the soft context (Sec. 4.2), the hard context
(Eq. 8-9), the gate β (Sec. 4.2.1), the LSTM (Eq. 1-3), the deep output (Eq. 7), one decoding
step, and the teacher-forced pass over a caption.

Dimensions, named once (docs/METHOD.md): ``B`` batch, ``T`` caption steps, ``L`` annotation
locations, ``D`` annotation size, ``m`` embedding size, ``n`` LSTM size, ``A`` attention-MLP
size, ``K`` vocabulary size, ``k`` rows (beams) per image.

Step modes: ``"train"`` (hard attention samples s̃ ~ Multinoulli(α), with semi-sampling; soft
attention takes the expectation), ``"expected"`` (ẑ = β Σ α a, the authors' test-time default),
``"sample"`` (one sampled location, no semi-sampling) and ``"argmax"`` (the most attended
location).

A ``Backend``, given by the model factory, may compute ``forward`` or ``step`` faster: the same
function (``tests/sat_model/model/test_backend.py`` holds it to it), or None where it does not
apply and the code here runs (docs/METHOD.md, "The backend").
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor, nn

from sat_model.model.config import SEMI_SAMPLING_PER, ModelConfig
from sat_model.model.outputs import AttentionOutput, DecoderState, ForwardOutput, StepOutput

__all__ = [
    "MODES",
    "SEMI_SAMPLING_PER",
    "Backend",
    "HardAttention",
    "ModelConfig",
    "ShowAttendTell",
    "SoftAttention",
]

MODES = ("train", "expected", "sample", "argmax")


class SoftAttention(nn.Module):
    """``f_att`` (Eq. 4-5) and the expected context Σ_i α_i a_i (Sec. 4.2)."""

    def __init__(self, annotation_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.annotation_proj = nn.Linear(annotation_dim, attention_dim)  # W_a, b
        self.hidden_proj = nn.Linear(hidden_dim, attention_dim, bias=False)  # W_h
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w_att; a bias cancels in Eq. 5

    def project(self, annotations: Tensor) -> Tensor:
        """W_a a_i + b (B, L, D) -> (B, L, A): the part of Eq. 4 that is fixed per image."""
        projected: Tensor = self.annotation_proj(annotations)
        return projected

    def scores(self, projected: Tensor, hidden: Tensor) -> Tensor:
        """e_ti = w_att^T tanh(W_a a_i + W_h h_{t-1} + b) (Eq. 4): (B*k, L) for k rows per image."""
        B, L, A = projected.shape
        query = self.hidden_proj(hidden).view(B, -1, 1, A)  # (B, k, 1, A)
        u = torch.tanh(projected.unsqueeze(1) + query)  # (B, k, L, A)
        e: Tensor = self.score(u)  # (B, k, L, 1)
        return e.view(-1, L)  # (B*k, L)

    def forward(
        self,
        annotations: Tensor,
        projected: Tensor,
        hidden: Tensor,
        mode: str = "expected",
        use_expected: Tensor | None = None,
        location: Tensor | None = None,
    ) -> AttentionOutput:
        alpha = torch.softmax(self.scores(projected, hidden), dim=-1)  # (B*k, L), Eq. 5
        if mode in ("train", "expected"):
            return AttentionOutput(alpha, expected_context(annotations, alpha))
        return AttentionOutput(alpha, gather_location(annotations, pick_location(alpha, mode)))


class HardAttention(SoftAttention):
    """Stochastic attention (Sec. 4.1): ẑ_t = a at s̃_t ~ Multinoulli(α_t) (Eq. 8-9).

    ``use_expected`` (B,) bool: semi-sampling, α instead of s̃ for those images; ``location``
    (B,) long forces s̃_t (exact enumeration of Eq. 10)."""

    def forward(
        self,
        annotations: Tensor,
        projected: Tensor,
        hidden: Tensor,
        mode: str = "expected",
        use_expected: Tensor | None = None,
        location: Tensor | None = None,
    ) -> AttentionOutput:
        log_alpha = torch.log_softmax(self.scores(projected, hidden), dim=-1)  # (B, L), Eq. 5
        alpha = log_alpha.exp()
        entropy = -(alpha * log_alpha).sum(-1)  # (B,) H[α_t], the entropy term of Sec. 4.1
        if mode == "expected" and location is None:
            return AttentionOutput(alpha, expected_context(annotations, alpha), entropy=entropy)
        if location is None:
            location = pick_location(alpha, mode)  # s̃_t, Eq. 8
        context = gather_location(annotations, location)  # (B, D), Eq. 9
        if use_expected is not None:  # semi-sampling (Sec. 4.1)
            expected = expected_context(annotations, alpha)
            context = torch.where(use_expected.unsqueeze(1), expected, context)
        log_prob = log_alpha.gather(1, location.unsqueeze(1)).squeeze(1)  # (B,) log α_{t,s̃}
        return AttentionOutput(alpha, context, log_prob, entropy, location)


def expected_context(annotations: Tensor, alpha: Tensor) -> Tensor:
    """Σ_i α_i a_i (Sec. 4.2): (B, L, D), (B*k, L) -> (B*k, D), an image's k rows in one product."""
    B, L, D = annotations.shape
    return torch.bmm(alpha.view(B, -1, L), annotations).view(-1, D)


def gather_location(annotations: Tensor, location: Tensor) -> Tensor:
    """a_{s̃}: (B, L, D), (B*k,) -> (B*k, D); the one-hot sum of Eq. 9 without the multiply."""
    B, _, D = annotations.shape
    index = location.view(B, -1, 1).expand(-1, -1, D)  # (B, k, D)
    return annotations.gather(1, index).view(-1, D)


def pick_location(alpha: Tensor, mode: str) -> Tensor:
    """s̃_t (B,): the argmax, or a draw from Multinoulli(α) (Eq. 8) by the inverse CDF (the
    same distribution as ``torch.multinomial``, which draws L exponentials per row)."""
    if mode == "argmax":
        return alpha.argmax(-1)
    if mode not in ("train", "sample"):
        raise ValueError(f"no location to pick in mode {mode!r}; expected one of {MODES}")
    cdf = alpha.detach().cumsum(-1)  # (B, L)
    u = torch.rand_like(cdf[:, :1]) * cdf[:, -1:]  # (B, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=alpha.size(-1) - 1)


class Backend(Protocol):
    """Another computation of ``ShowAttendTell.forward`` and ``step``: its result, or None
    where it does not apply (then the code here runs)."""

    def forward(
        self, model: ShowAttendTell, a: Tensor, y: Tensor, mode: str, s: Tensor | None, k: int, /
    ) -> ForwardOutput | None:
        """The pass over annotations (B/k, L, D) and inputs y (B, T), forced s̃ (B, T) or
        None, k rows per image."""

    def step(
        self, model: ShowAttendTell, y: Tensor, state: DecoderState, mode: str, /
    ) -> StepOutput | None:
        """One decoding step from y_{t-1} (B,) and the state at t-1."""


class ShowAttendTell(nn.Module):
    """The decoder of Sec. 3.1.2 with soft or hard attention, over precomputed annotations."""

    def __init__(self, config: ModelConfig, backend: Backend | None = None) -> None:
        super().__init__()
        self.config = config
        D, m, n, K = config.annotation_dim, config.embed_dim, config.hidden_dim, config.vocab_size
        if config.normalize_features:
            self.register_buffer("feature_mean", torch.zeros(D))
            self.register_buffer("feature_std", torch.ones(D))
        else:
            self.feature_mean = self.feature_std = None
        if config.coordinates:  # derived from the config, so not in the state dict
            self.register_buffer("coords", _cell_coordinates(config), persistent=False)
            D += 2
        else:
            self.coords = None
        self.embedding = nn.Embedding(K, m)  # E
        attention_cls = HardAttention if config.attention == "hard" else SoftAttention
        self.attention = attention_cls(D, n, config.attention_dim)
        self.init_h = nn.Linear(D, n)  # h_0 = tanh(f_init,h(ā)), Sec. 3.1.2
        self.init_c = nn.Linear(D, n)  # c_0 = tanh(f_init,c(ā))
        self.gate = nn.Linear(n, 1) if config.gate else None  # f_β (Sec. 4.2.1)
        self.lstm = nn.LSTMCell(m + D, n)  # T_{m+n+D,4n} of Eq. 1 over [E y_{t-1}; ẑ_t], h_{t-1}
        self.hidden_out = nn.Linear(n, m, bias=False)  # L_h (Eq. 7)
        self.context_out = nn.Linear(D, m, bias=False)  # L_z (Eq. 7)
        self.dropout = nn.Dropout(config.dropout)  # before L_o (authors' code)
        self.input_dropout = nn.Dropout(config.input_dropout)
        self.out = nn.Linear(m, K)  # L_o (Eq. 7)
        self.backend = backend

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

    def prepare(self, annotations: Tensor) -> Tensor:
        """The annotations attended over (B, L, D): standardised, with cell coordinates."""
        self._check_annotations(annotations)
        if self.feature_mean is not None and self.feature_std is not None:
            annotations = (annotations - self.feature_mean) / self.feature_std
        if self.coords is not None:
            coords = self.coords.to(annotations.dtype).expand(annotations.size(0), -1, -1)
            annotations = torch.cat([annotations, coords], dim=2)  # (B, L, D + 2)
        return annotations

    def init_state(self, annotations: Tensor, rows_per_image: int = 1) -> DecoderState:
        """h_0, c_0 from the mean annotation ā (Sec. 3.1.2) and W_a a + b, once per image;
        ``rows_per_image`` repeats them for k captions of each image."""
        a = self.prepare(annotations)  # (B, L, D)
        mean, projected = a.mean(dim=1), self.attention.project(a)  # (B, D), (B, L, A)
        if rows_per_image > 1:
            a, mean, projected = (
                t.repeat_interleave(rows_per_image, 0) for t in (a, mean, projected)
            )
        h, c = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B, n)
        return DecoderState(h=h, c=c, annotations=a, projected=projected)

    def advance(
        self,
        embedded: Tensor,
        state: DecoderState,
        mode: str,
        use_expected: Tensor | None = None,
        location: Tensor | None = None,
    ) -> tuple[DecoderState, AttentionOutput, Tensor, Tensor]:
        """Attention from h_{t-1} (Eq. 4-6), the gate β_t, then the LSTM (Eq. 1-3) on
        [E y_{t-1}; ẑ_t] (B, m): the new state, the attention, ẑ_t (B, D) and β_t (B,)."""
        att = self.attention(
            state.annotations, state.projected, state.h, mode, use_expected, location
        )
        beta = att.context.new_ones(att.context.size(0))  # β_t = 1 without the gate
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(state.h)).squeeze(1)  # β_t = σ(f_β(h_{t-1}))
        z = beta.unsqueeze(1) * att.context  # ẑ_t = β_t φ({a_i}, {α_ti}), Sec. 4.2.1
        h, c = self.lstm(torch.cat([embedded, z], dim=1), (state.h, state.c))  # Eq. 1-3
        return dataclasses.replace(state, h=h, c=c), att, z, beta

    def deep_output(self, embedded: Tensor, hidden: Tensor, context: Tensor) -> Tensor:
        """Eq. 7: L_o(E y_{t-1} + L_h h_t + L_z ẑ_t) (…, K); tanh, dropout before L_o (authors')."""
        pre = embedded + self.hidden_out(hidden) + self.context_out(context)  # (…, m)
        logits: Tensor = self.out(self.dropout(torch.tanh(pre)))
        return logits

    def step(self, prev_tokens: Tensor, state: DecoderState, mode: str = "expected") -> StepOutput:
        """One decoding step from y_{t-1} (B,) and the state at t-1: the backend's where it
        gives one, else ``readable_step``."""
        _check_mode(mode)
        if self.backend is not None:
            out = self.backend.step(self, prev_tokens, state, mode)
            if out is not None:
                return out
        return self.readable_step(prev_tokens, state, mode)

    def readable_step(self, prev_tokens: Tensor, state: DecoderState, mode: str) -> StepOutput:
        """``step``'s equations: Eq. 4-6 and 1-3 (``advance``), then Eq. 7."""
        embedded = self.embedding(prev_tokens)  # (B, m)
        state, att, z, beta = self.advance(embedded, state, mode)
        logits = self.deep_output(embedded, state.h, z)  # (B, K)
        return StepOutput(
            logits, att.alpha, state, beta, att.location_log_prob, att.entropy, att.location
        )

    def forward(
        self,
        annotations: Tensor,
        captions: Tensor,
        *,
        mode: str | None = None,
        locations: Tensor | None = None,
        rows_per_image: int = 1,
    ) -> ForwardOutput:
        """Teacher-forced pass over ``captions[:, :-1]`` (B, T): prepare, loop over the steps,
        then the deep output once over all T. ``mode``: "train" in training mode, "expected" in
        eval mode by default; ``locations`` (B, T) forces hard attention's s̃ (no
        semi-sampling); ``annotations`` holds B/k images for ``rows_per_image`` = k captions each.
        """
        mode = mode or ("train" if self.training else "expected")
        _check_mode(mode)
        inputs = captions[:, :-1]  # (B, T)
        if rows_per_image < 1 or annotations.size(0) * rows_per_image != inputs.size(0):
            raise ValueError(
                f"{inputs.size(0)} captions for {annotations.size(0)} images at "
                f"rows_per_image={rows_per_image}"
            )
        if self.backend is not None:
            out = self.backend.forward(self, annotations, inputs, mode, locations, rows_per_image)
            if out is not None:
                return out
        state = self.init_state(annotations, rows_per_image)
        use_expected = self.semi_sampling_mask(inputs.size(0), mode, locations, inputs.device)
        embedded = self.embedding(inputs)  # (B, T, m)
        lstm_embedded = self.input_dropout(embedded)  # only where E y_{t-1} enters Eq. 1
        steps = []
        for t in range(inputs.size(1)):
            location = None if locations is None else locations[:, t]
            state, att, z, beta = self.advance(
                lstm_embedded[:, t], state, mode, use_expected, location
            )
            steps.append((state.h, z, att, beta))
        hidden, context, atts, betas = zip(*steps, strict=True)
        return ForwardOutput(
            logits=self.deep_output(embedded, torch.stack(hidden, 1), torch.stack(context, 1)),
            alphas=torch.stack([a.alpha for a in atts], dim=1),  # (B, T, L)
            betas=torch.stack(betas, dim=1),  # (B, T)
            location_log_probs=_stack([a.location_log_prob for a in atts]),  # (B, T)
            entropy=_stack([a.entropy for a in atts]),  # (B, T)
            sampled=None if use_expected is None else ~use_expected,
        )

    def semi_sampling_mask(
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


def _cell_coordinates(config: ModelConfig) -> Tensor:
    """(x, y) of every cell centre in [-1, 1], row-major as the feature map is flattened: (L, 2).
    On the CPU, whatever the default device (the meta device of a shape check): moved with the
    model."""
    grid_h, grid_w = config.num_locations // config.grid_w, config.grid_w
    cpu = torch.device("cpu")
    ys = (torch.arange(grid_h, dtype=torch.float32, device=cpu) + 0.5) / grid_h * 2 - 1  # (grid_h,)
    xs = (torch.arange(grid_w, dtype=torch.float32, device=cpu) + 0.5) / grid_w * 2 - 1  # (grid_w,)
    y, x = torch.meshgrid(ys, xs, indexing="ij")  # (grid_h, grid_w) each
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # (L, 2)


def _stack(values: tuple[Tensor | None, ...] | list[Tensor | None]) -> Tensor | None:
    return None if values[0] is None else torch.stack(values, dim=1)  # type: ignore[arg-type]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
