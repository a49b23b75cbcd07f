"""``NativeBackend`` (``model.backend: native``): ``ShowAttendTell``'s functions on the kernels.

The model asks it first for a teacher-forced pass (the ``Backend`` protocol of ``decoder.py``);
it answers a pass in the "train" or "expected" mode, or with forced locations for hard
attention, without autocast and with annotations that need no gradient: the T steps of
Eq. 1-6 as one autograd node (``recurrence.py``), the embedding's share of Eq. 1 for all T
steps in one product, and the deep output (Eq. 7) by the model's own ``deep_output``.
Elsewhere it returns None and the readable code runs. Decoding is the readable step's, under
``torch.compile`` where ``compile_decoding`` asks for it (compiled once per model class and
process, at the first step; CPU tensors without autograd in the modes that draw nothing,
where the compiled step gives the readable step's captions).

Only float32 CPU tensors and a model of exactly the stock modules (``fits``) take it. Eq. 4's
scores go through tanh(u) = 2σ(2u) - 1, whose constant term cancels in Eq. 5's softmax
(docs/METHOD.md, "The backend").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from sat_model.model.decoder import HardAttention, ShowAttendTell, SoftAttention
from sat_model.model.kernels import native
from sat_model.model.kernels.recurrence import Weights, recurrence
from sat_model.model.outputs import DecoderState, ForwardOutput, StepOutput

__all__ = ["NativeBackend", "fits"]

_LINEARS = ("init_h", "init_c", "hidden_out", "context_out", "out")
# the model's methods the backend stands in for or calls: a subclass that redefines one runs
# the readable code
_EQUATIONS = ("prepare", "advance", "deep_output", "semi_sampling_mask")
_DETERMINISTIC = ("expected", "argmax")  # the step modes that draw nothing


class NativeBackend:
    """The compiled kernels behind ``ShowAttendTell.forward``; ``compile_decoding``: the
    readable decoding step through ``torch.compile`` (off by default: it did not pay for its
    compile time, docs/decisions/001-backend-against-torch-compile.md)."""

    def __init__(self, compile_decoding: bool = False) -> None:
        self.compile_decoding = compile_decoding

    def step(
        self, model: ShowAttendTell, prev_tokens: Tensor, state: DecoderState, mode: str
    ) -> StepOutput | None:
        """``ShowAttendTell.readable_step`` compiled; None (the readable step) where not asked
        for, and where a compiled step would differ: with autograd, off the CPU, or drawing a
        location (the compiled code draws from another random stream)."""
        if not self.compile_decoding:
            return None
        if mode not in _DETERMINISTIC or torch.is_grad_enabled() or state.h.device.type != "cpu":
            return None
        return _compiled_step(type(model).readable_step)(model, prev_tokens, state, mode)

    def forward(
        self,
        model: ShowAttendTell,
        annotations: Tensor,
        inputs: Tensor,
        mode: str,
        locations: Tensor | None,
        rows_per_image: int,
    ) -> ForwardOutput | None:
        """``ShowAttendTell.forward`` through ``recurrence``; None where it does not apply."""
        hard_model = model.config.attention == "hard"
        if not (mode in ("train", "expected") or (hard_model and locations is not None)):
            return None
        if (locations is not None and not hard_model) or annotations.requires_grad:
            return None
        if torch.is_autocast_enabled("cpu") or not fits(model, annotations):
            return None
        kernels = _training_kernels()
        hard, sampled = None, None
        if hard_model:
            B, T = inputs.shape
            use_expected = model.semi_sampling_mask(B, mode, locations, annotations.device)
            if use_expected is None:  # "expected": α's context for every image, nothing drawn
                use_expected = torch.ones(B, dtype=torch.bool)
                locations = torch.zeros(B, T, dtype=torch.long)
            else:
                sampled = ~use_expected
            hard = (use_expected, None if locations is None else locations.t())
        a = model.prepare(annotations)  # (B, L, D)
        mean, projected = a.mean(dim=1), _locations_last(model.attention.project(a))
        if rows_per_image > 1:
            a, mean, projected = (
                t.repeat_interleave(rows_per_image, 0) for t in (a, mean, projected)
            )
        embedded = model.embedding(inputs)  # (B, T, m)
        initial = (torch.tanh(model.init_h(mean)), torch.tanh(model.init_c(mean)))
        gates_in = _embedding_gates(model.lstm, model.input_dropout(embedded))
        out = recurrence(kernels, projected, a, initial, gates_in, _weights(model), hard)
        return ForwardOutput(
            logits=model.deep_output(
                embedded, _steps_second(out.hidden), _steps_second(out.context)
            ),
            alphas=_steps_second(out.alphas),  # (B, T, L)
            betas=_steps_second(out.betas),  # (B, T)
            # none where nothing was sampled, as the readable loop gives
            location_log_probs=None
            if sampled is None or out.location_log_probs is None
            else _steps_second(out.location_log_probs),
            entropy=None if out.entropy is None else _steps_second(out.entropy),
            sampled=sampled,
        )


def fits(model: ShowAttendTell, annotations: Tensor) -> bool:
    """Whether the kernels compute ``model`` on ``annotations``: float32 on CPU, and exactly
    the stock modules and equations (a replaced attention, cell or layer runs the readable
    code)."""
    stock = HardAttention if model.config.attention == "hard" else SoftAttention
    cls = type(model)
    return (
        annotations.device.type == "cpu"
        and annotations.dtype == torch.float32
        and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
        and type(model.attention) is stock
        and type(model.lstm) is nn.LSTMCell
        and type(model.embedding) is nn.Embedding
        and all(type(getattr(model, name)) is nn.Linear for name in _LINEARS)
        and (model.gate is None or type(model.gate) is nn.Linear)
        and all(getattr(cls, f) is getattr(ShowAttendTell, f) for f in _EQUATIONS)
    )


@functools.cache
def _compiled_step(step: Callable[..., StepOutput]) -> Callable[..., StepOutput]:
    """A model class's ``readable_step`` under ``torch.compile``: one per class and process,
    compiled at its first call (again for a new batch size, then once for any size; past
    torch's limit of recompiles, the readable step runs as it is)."""
    return torch.compile(step)


def _training_kernels() -> native.NativeKernels:
    """The kernels for a training pass; where they cannot be had, an error rather than the
    readable code: the two paths draw and round differently, and the run's params name this one."""
    kernels = native.load()
    if kernels is None or kernels.sgemm is None:
        raise RuntimeError(
            "model.backend is native, but its compiled kernels are not available here (see the "
            "warning above): install a C++ compiler, or set model.backend: readable"
        )
    return kernels


def _weights(model: ShowAttendTell) -> Weights:
    """The recurrence's weights from the model's modules, differentiable."""
    m, gate, lstm = model.config.embed_dim, model.gate, model.lstm
    return Weights(
        hidden2=2.0 * model.attention.hidden_proj.weight,
        score=model.attention.score.weight,
        gate=None if gate is None else gate.weight,
        gate_bias=None if gate is None else gate.bias,
        lstm=torch.cat([lstm.weight_ih[:, m:], lstm.weight_hh], dim=1),  # [W_z W_h], Eq. 1
    )


def _locations_last(projected: Tensor) -> Tensor:
    """2(W_a a_i + b), (B, L, A) -> (B, A, L): the kernels' loops run along L, and σ(2u) takes
    the factor 2."""
    return 2.0 * projected.transpose(1, 2).contiguous()


def _embedding_gates(lstm: nn.LSTMCell, embedded: Tensor) -> Tensor:
    """The embedding's share of Eq. 1 with both biases, (B, T, m) -> (T, B, 4n): one product
    for all T steps."""
    B, T, m = embedded.shape
    return torch.addmm(
        lstm.bias_ih + lstm.bias_hh,
        embedded.transpose(0, 1).reshape(T * B, m),
        lstm.weight_ih[:, :m].t(),
    ).view(T, B, -1)


def _steps_second(steps: Tensor) -> Tensor:
    return steps.transpose(0, 1)  # (T, B, ·) -> (B, T, ·)
