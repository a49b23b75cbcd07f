"""Compiled kernels for the decoder's attention and LSTM steps (``native_kernels.cpp``), built
on first use and called through ctypes.

At the default sizes a training step is ~20 small steps of a few dozen elementwise ops each, and
the largest tensor, the attention's (B*k, A, L), goes through memory five to seven times per
step in PyTorch's eager ops (add, σ, product, sums, gradient). The kernels do each of these
pieces in one pass (docs/EXPERIMENTS.md, "Training speed"):

- ``scores_forward`` / ``scores_backward``: Eq. 4's scores (the hard model's step);
- ``attend_forward`` / ``attend_backward``: soft attention's step, scores, softmax (Eq. 5) and
  the expected context, in training and decoding;
- ``lstm_forward`` / ``lstm_backward``: Eq. 1-3 after the gates' matrix product.

The matrix products stay with PyTorch (MKL, oneDNN). The first call compiles the source through
``torch.utils.cpp_extension`` with the machine's C++ compiler (``$CXX``, else ``c++``) for this
CPU (``-march=native``) into ``$XDG_CACHE_HOME/sat/kernels`` (default ``~/.cache``), in a folder
named by the CPU's features, so another machine builds its own; later processes load the built
library (ninja rebuilds it when the source or the flags change). Where there is no compiler or
the build fails, ``load`` returns None, a warning says why (once per process), every function
here returns None or False, and the callers (``fused.py``, ``backend.py``) run their PyTorch code
instead: the same numbers up to float rounding. float32 on CPU only; other dtypes and devices
always take the PyTorch code. The ``fused`` backend (``model.backend``) runs its passes inside
``enabled(False)``: the same PyTorch code, and no build is tried.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "PROJECTED_CLAMP",
    "QUERY_BOUND",
    "NativeKernels",
    "attend_backward",
    "attend_forward",
    "available",
    "cache_dir",
    "cpu_vendor",
    "enabled",
    "exp_of_projected",
    "hard_recurrence_backward",
    "hard_recurrence_forward",
    "is_enabled",
    "load",
    "lstm_backward",
    "lstm_forward",
    "scores_backward",
    "scores_forward",
    "soft_recurrence_backward",
    "soft_recurrence_forward",
]

# the source's kProjectedClamp and kQueryBound (for tests and docs): e^{-p} of p clamped to ±52,
# for rows with |q| <= 34
PROJECTED_CLAMP, QUERY_BOUND = 52.0, 34.0
SOURCE = Path(__file__).with_name("native_kernels.cpp")
# compiled with -ffast-math, so that the loops vectorise, and linked without it (see the source)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LINK_FLAGS = ("-fopenmp", "-lm")

_log = logging.getLogger(__name__)
# the C functions (``sat_<name>``): how many pointer arguments, then how many int64 ones
_SIGNATURES = {
    "scores_forward": (4, 5),
    "scores_backward": (7, 6),
    "attend_forward": (7, 7),
    "exp_of_projected": (2, 2),
    "attend_backward": (10, 6),
    "lstm_forward": (5, 4),
    "lstm_backward": (7, 3),
    "soft_recurrence_forward": (17, 7),
    "soft_recurrence_backward": (26, 7),
    "hard_recurrence_forward": (23, 7),
    "hard_recurrence_backward": (33, 7),
}


class NativeKernels:
    """The loaded library's functions with their C signatures."""

    scores_forward: Callable[..., None]
    scores_backward: Callable[..., None]
    soft_recurrence_forward: Callable[..., None]
    soft_recurrence_backward: Callable[..., None]
    hard_recurrence_forward: Callable[..., None]
    hard_recurrence_backward: Callable[..., None]
    attend_forward: Callable[..., None]
    exp_of_projected: Callable[..., None]
    attend_backward: Callable[..., None]
    lstm_forward: Callable[..., None]
    lstm_backward: Callable[..., None]

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, (pointers, integers) in _SIGNATURES.items():
            function = getattr(library, f"sat_{name}")
            function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * integers
            function.restype = None
            setattr(self, name, function)


def _call(function: Callable[..., None], tensors: list[Tensor | None], *sizes: int) -> None:
    """``function`` on the tensors' data (a null pointer for None), then the sizes."""
    function(*(None if t is None else t.data_ptr() for t in tensors), *sizes)


@functools.cache
def _sgemm() -> int | None:
    """The address of BLAS's ``sgemm_`` in the MKL that torch links (``libtorch_cpu``), for the
    recurrence kernels' matrix products; None where this torch build exports none."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        function = ctypes.CDLL(str(library)).sgemm_
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sat" / "kernels"


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built or taken from the cache; None (with one warning) where they cannot
    be had."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        _log.warning(
            "no C++ compiler (CXX or c++) on PATH: the attention and LSTM steps run in "
            "PyTorch's eager ops, slower (the fused backend, model.backend: fused or "
            "SAT_MODEL_BACKEND=fused, runs them so without looking for one)"
        )
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _log.warning(
            "the native attention and LSTM kernels could not be built (%s); running PyTorch's "
            "eager ops instead (the fused backend, model.backend: fused or "
            "SAT_MODEL_BACKEND=fused, runs them so without building)",
            first_line,
        )
        return None


def _build() -> Path:
    """The library for this source and CPU, built by PyTorch's extension machinery
    (``torch.utils.cpp_extension.load``: ninja, rebuilt when the source or the flags change, a
    lock for processes that build at once) into a folder named by the CPU's features, since
    ``-march=native`` compiles for this CPU only."""
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its import logs where it looked for CUDA, which we never use
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    name = "sat_kernels_" + hashlib.sha256(_cpu_features().encode()).hexdigest()[:16]
    directory = cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # its compiler checks warn on their own; one warning here
        warnings.simplefilter("ignore")
        path = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=list(COMPILE_FLAGS),
            extra_ldflags=list(LINK_FLAGS),
            build_directory=str(directory),
            is_python_module=False,
        )
    return Path(str(path))


@functools.cache
def _cpuinfo() -> tuple[str, ...] | None:
    """The lines of /proc/cpuinfo, read once a process; None where there is none."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines())
    except OSError:
        return None


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    if (lines := _cpuinfo()) is None:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def cpu_vendor() -> str | None:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD"), where /proc/cpuinfo says."""
    for line in _cpuinfo() or ():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return None


# whether the kernels may run in this context: the fast backend sets it for each pass
# (``enabled``); threads and autograd's backward start from True unless told otherwise
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("sat_native", default=True)


@contextlib.contextmanager
def enabled(flag: bool) -> Iterator[None]:
    """Inside the block the kernels run where they can if ``flag``, and never otherwise (the
    PyTorch code of ``fused.py`` and ``backend.py`` instead, and no build is tried)."""
    token = _ENABLED.set(flag)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def is_enabled() -> bool:
    """What the innermost ``enabled`` said (True outside any): autograd functions keep it for
    their backward, which runs outside the block."""
    return _ENABLED.get()


def _usable(*tensors: Tensor) -> bool:
    return _ENABLED.get() and all(
        t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors
    )


def available(*tensors: Tensor) -> bool:
    """Whether the kernels can run on these tensors: a caller's check before it prepares
    their inputs, so that the fallback does not pay for them."""
    return _usable(*tensors) and load() is not None


def scores_forward(projected: Tensor, query: Tensor, weight: Tensor) -> Tensor | None:
    """Σ_a 2 w_a σ(P + q) (``fused.fused_scores``): (B, A, L), (B*k, A), (1, A) -> (B*k, L);
    None where the kernels are off or the tensors are not float32 on CPU."""
    if not _usable(projected, query, weight) or (kernels := load()) is None:
        return None
    projected, query = projected.contiguous(), query.contiguous()
    B, A, L = projected.shape
    k = query.size(0) // B
    weight2 = 2.0 * weight.reshape(A)
    scores = projected.new_empty(B * k, L)
    _call(
        kernels.scores_forward,
        [projected, query, weight2, scores],
        B,
        k,
        A,
        L,
        torch.get_num_threads(),
    )
    return scores


def scores_backward(
    grad: Tensor, projected: Tensor, query: Tensor, weight: Tensor, grad_projected: Tensor | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``fused.fused_scores_backward`` in one pass: the gradients for ``projected`` (written
    into a new tensor, or added to ``grad_projected`` when given), ``query`` and ``weight``;
    None where the kernels cannot run on these tensors."""
    tensors = [grad, projected, query, weight]
    if grad_projected is not None:
        if not grad_projected.is_contiguous():
            return None
        tensors.append(grad_projected)
    if not _usable(*tensors) or (kernels := load()) is None:
        return None
    grad, projected, query = grad.contiguous(), projected.contiguous(), query.contiguous()
    B, A, L = projected.shape
    k = query.size(0) // B
    weight2 = 2.0 * weight.reshape(A)
    accumulate = grad_projected is not None
    out = grad_projected if grad_projected is not None else projected.new_empty(B, A, L)
    grad_query = query.new_empty(B * k, A)
    weight_rows = query.new_empty(B * k, A)
    _call(
        kernels.scores_backward,
        [grad, projected, query, weight2, out, grad_query, weight_rows],
        B,
        k,
        A,
        L,
        torch.get_num_threads(),
        int(accumulate),
    )
    return out, grad_query, (2.0 * weight_rows.sum(0)).view(1, A)


def lstm_forward(
    gates: Tensor, cell_prev: Tensor, cell: Tensor, hidden: Tensor, next_input: Tensor | None
) -> bool:
    """Eq. 1-3 after the gates' product (``fused._forward_step``): activates ``gates`` (B, 4n)
    in place, writes c_t into ``cell`` and h_t into ``hidden`` and ``next_input`` (a (B, n)
    view with rows of any stride). False, with nothing written, where the kernels cannot run."""
    written = [gates, cell, hidden] + ([] if next_input is None else [next_input])
    if not _usable(cell_prev, *written) or not all(
        t.is_contiguous() for t in (gates, cell, hidden)
    ):
        return False
    if next_input is not None and next_input.stride(1) != 1:
        return False
    if (kernels := load()) is None:
        return False
    B, n = cell.shape
    cell_prev = cell_prev.contiguous()
    _call(
        kernels.lstm_forward,
        [gates, cell_prev, cell, hidden, next_input],
        0 if next_input is None else next_input.stride(0),
        B,
        n,
        torch.get_num_threads(),
    )
    return True


def lstm_backward(
    gates: Tensor,
    cell_prev: Tensor,
    cell: Tensor,
    grad_hidden: Tensor,
    grad_output: Tensor,
    grad_cell: Tensor,
    grad_gates: Tensor,
) -> bool:
    """Eq. 1-3 backwards (``fused._lstm_backward``): ∂/∂ the gates' pre-activations into
    ``grad_gates`` (B, 4n), ``grad_cell`` from ∂/∂c_t to ∂/∂c_{t-1} in place. False, with
    nothing written, where the kernels cannot run."""
    tensors = (gates, cell_prev, cell, grad_hidden, grad_output, grad_cell, grad_gates)
    if not _usable(*tensors) or not (grad_cell.is_contiguous() and grad_gates.is_contiguous()):
        return False
    if (kernels := load()) is None:
        return False
    B, n = cell.shape
    inputs = [t.contiguous() for t in (gates, cell_prev, cell, grad_hidden, grad_output)]
    _call(kernels.lstm_backward, [*inputs, grad_cell, grad_gates], B, n, torch.get_num_threads())
    return True


def attend_forward(
    projected: Tensor,
    query: Tensor,
    weight: Tensor,
    annotations: Tensor,
    alpha: Tensor,
    context: Tensor,
    exp_projected: Tensor | None = None,
) -> bool:
    """Soft attention's step for k rows per image: the scores (``scores_forward``), α =
    softmax into ``alpha`` (B*k, L) and Σ_i α_i a_i into ``context`` (B*k, D; rows of any
    stride). ``exp_projected``, from ``exp_of_projected``, spares the exponential of every
    (row, a, l): the scores then read σ(p + q) as 1 / (1 + e^{-p} e^{-q}). False, with nothing
    written, where the kernels cannot run."""
    if not _usable(projected, query, weight, annotations, alpha, context):
        return False
    if exp_projected is not None and not _usable(exp_projected):
        exp_projected = None
    if not alpha.is_contiguous() or context.stride(1) != 1 or (kernels := load()) is None:
        return False
    B, A, L = projected.shape
    k, D = query.size(0) // B, annotations.size(2)
    projected, query, annotations = (t.contiguous() for t in (projected, query, annotations))
    if exp_projected is not None:
        exp_projected = exp_projected.contiguous()
    weight2 = 2.0 * weight.reshape(A)
    _call(
        kernels.attend_forward,
        [projected, exp_projected, query, weight2, annotations, alpha, context],
        context.stride(0),
        B,
        k,
        A,
        L,
        D,
        torch.get_num_threads(),
    )
    return True


def exp_of_projected(projected: Tensor) -> Tensor | None:
    """e^{-p} (B, A, L) of ``projected`` clamped to ±PROJECTED_CLAMP, for ``attend_forward``,
    once per image, computed by the kernel the training recurrences use (the source says why
    the clamp changes no float the scores hold); None where the kernels cannot run."""
    if not _usable(projected) or (kernels := load()) is None:
        return None
    projected = projected.contiguous()
    out = torch.empty_like(projected)
    _call(kernels.exp_of_projected, [projected, out], out.numel(), torch.get_num_threads())
    return out


def attend_backward(
    grad_context: Tensor,
    grad_alpha: Tensor | None,
    alpha: Tensor,
    annotations: Tensor,
    projected: Tensor,
    query: Tensor,
    weight: Tensor,
    grad_projected: Tensor | None,
    grad_query: Tensor,
) -> tuple[Tensor, Tensor] | None:
    """``attend_forward`` backwards for one row per image, the annotations held fixed: from
    ∂/∂φ (B, D) and the loss's ∂/∂α (B, L), the gradient for ``projected`` (a new tensor, or
    added to ``grad_projected``) and for ``weight`` (1, A); ∂/∂query into ``grad_query``.
    None, with nothing written, where the kernels cannot run."""
    tensors = [grad_context, alpha, annotations, projected, query, weight, grad_query]
    tensors += [t for t in (grad_alpha, grad_projected) if t is not None]
    if not _usable(*tensors) or not grad_query.is_contiguous():
        return None
    if grad_projected is not None and not grad_projected.is_contiguous():
        return None
    if (kernels := load()) is None:
        return None
    B, A, L = projected.shape
    D = annotations.size(2)
    grad_context, alpha, annotations, projected, query = (
        t.contiguous() for t in (grad_context, alpha, annotations, projected, query)
    )
    grad_alpha = None if grad_alpha is None else grad_alpha.contiguous()
    weight2 = 2.0 * weight.reshape(A)
    accumulate = grad_projected is not None
    out = grad_projected if grad_projected is not None else projected.new_empty(B, A, L)
    weight_rows = query.new_empty(B, A)
    _call(
        kernels.attend_backward,
        [
            grad_context,
            grad_alpha,
            alpha,
            annotations,
            projected,
            query,
            weight2,
            out,
            grad_query,
            weight_rows,
        ],
        B,
        A,
        L,
        D,
        torch.get_num_threads(),
        int(accumulate),
    )
    return out, (2.0 * weight_rows.sum(0)).view(1, A)


def _recurrence_kernels(
    tensors: list[Tensor], indices: tuple[Tensor, ...] = ()
) -> tuple[NativeKernels, int] | None:
    """The kernels and ``sgemm_``'s address for a whole-recurrence call on ``tensors`` (float32)
    and hard attention's ``indices`` (bool and int64), all contiguous on CPU; or None."""
    if not _usable(*tensors) or any(t.device.type != "cpu" for t in indices):
        return None
    if not all(t.is_contiguous() for t in [*tensors, *indices]):
        return None
    if (kernels := load()) is None or (sgemm := _sgemm()) is None:
        return None
    return kernels, sgemm


def _call_recurrence(
    function: Callable[..., None],
    sgemm: int,
    pointers: list[Tensor | None],
    steps: int,
    projected: Tensor,
    annotations: Tensor,
    hidden2: Tensor,
) -> None:
    """``function`` on sgemm_, the tensors' data and the sizes T, B, A, L, D, n and threads."""
    B, A, L = projected.shape
    D, n = annotations.size(2), hidden2.size(1)
    sizes = (steps, B, A, L, D, n, torch.get_num_threads())
    _call(functools.partial(function, sgemm), pointers, *sizes)


def soft_recurrence_forward(
    projected: Tensor,
    annotations: Tensor,
    input_gates: Tensor,
    hidden2: Tensor,
    weight: Tensor,
    gate: Tensor | None,
    gate_bias: Tensor | None,
    lstm: Tensor,
    sequence: list[Tensor],
) -> bool:
    """All T steps of the soft training recurrence (``fused._Recurrence``) in one call: the
    attention and LSTM kernels above and the matrix products through torch's own BLAS. Fills
    ``sequence`` (``fused._Sequence``'s inputs, cells, gates, queries, alphas, contexts, betas
    and hidden, contiguous, with h_0 and c_0 in place); ``hidden2`` is 2 W_h (A, n), ``weight``
    w_att (1, A). False, with nothing written, where the kernels or the BLAS cannot run."""
    tensors = [projected, annotations, input_gates, hidden2, weight, lstm, *sequence]
    tensors += [t for t in (gate, gate_bias) if t is not None]
    if (found := _recurrence_kernels(tensors)) is None:
        return False
    kernels, sgemm = found
    weight2 = 2.0 * weight.reshape(-1)
    pointers = [projected, annotations, input_gates, hidden2, weight2, gate, gate_bias, lstm]
    _call_recurrence(
        kernels.soft_recurrence_forward,
        sgemm,
        pointers + list(sequence),
        input_gates.size(0),
        projected,
        annotations,
        hidden2,
    )
    return True


def soft_recurrence_backward(
    projected: Tensor,
    annotations: Tensor,
    hidden2: Tensor,
    weight: Tensor,
    gate: Tensor | None,
    lstm: Tensor,
    sequence: list[Tensor],
    d_outputs: list[Tensor],
    grads: list[Tensor],
) -> tuple[Tensor, Tensor] | None:
    """``soft_recurrence_forward`` backwards through time, the annotations held fixed.
    ``sequence``: the cells, gates, queries, alphas, contexts and betas the forward filled;
    ``d_outputs`` the gradients of its hidden states, gated contexts, α and β; ``grads`` ∂/∂h
    and ∂/∂c (zeros, left holding ∂/∂h_0 and ∂/∂c_0), then the gates', queries' and f_β's
    pre-activation's gradients (T, B, ·) to fill. Returns ∂/∂projected and ∂/∂w_att; None,
    with nothing written, where the kernels or the BLAS cannot run."""
    return _recurrence_backward(
        "soft", projected, annotations, hidden2, weight, gate, lstm, (), sequence, d_outputs, grads
    )


def hard_recurrence_forward(
    projected: Tensor,
    annotations: Tensor,
    input_gates: Tensor,
    hidden2: Tensor,
    weight: Tensor,
    gate: Tensor | None,
    gate_bias: Tensor | None,
    lstm: Tensor,
    use_expected: Tensor,
    locations: Tensor,
    sample: bool,
    sequence: list[Tensor],
) -> bool:
    """``soft_recurrence_forward`` for hard attention (Eq. 8-9, semi-sampling by
    ``use_expected`` (B,) bool). With ``sample``, s̃ is drawn from T·B uniforms taken here, once
    the kernels are known to run, from torch's generator in the order in which
    ``fused.sample_locations`` takes them step by step, and by the same inverse CDF, and written
    to ``locations`` (T, B); without, the forced path there is followed. ``sequence``:
    ``fused._Sequence``'s inputs, cells, gates, queries, alphas, contexts, betas, hidden,
    log_alphas, log_probs and entropy. False, with nothing written or drawn, where the kernels
    or the BLAS cannot run."""
    tensors = [projected, annotations, input_gates, hidden2, weight, lstm, *sequence]
    tensors += [t for t in (gate, gate_bias) if t is not None]
    if use_expected.dtype != torch.bool or locations.dtype != torch.int64:
        return False
    if (found := _recurrence_kernels(tensors, (use_expected, locations))) is None:
        return False
    kernels, sgemm = found
    T, B = locations.shape
    uniforms = torch.rand(T, B, dtype=projected.dtype) if sample else None
    weight2 = 2.0 * weight.reshape(-1)
    pointers = [projected, annotations, input_gates, hidden2, weight2, gate, gate_bias, lstm]
    pointers += [use_expected, uniforms, locations, *sequence]
    _call_recurrence(
        kernels.hard_recurrence_forward, sgemm, pointers, T, projected, annotations, hidden2
    )
    return True


def hard_recurrence_backward(
    projected: Tensor,
    annotations: Tensor,
    hidden2: Tensor,
    weight: Tensor,
    gate: Tensor | None,
    lstm: Tensor,
    use_expected: Tensor,
    locations: Tensor,
    sequence: list[Tensor],
    d_outputs: list[Tensor],
    grads: list[Tensor],
) -> tuple[Tensor, Tensor] | None:
    """``hard_recurrence_forward`` backwards through time, the annotations held fixed:
    ``soft_recurrence_backward`` with the gradients of log α_{t,s̃_t} and H[α_t] among
    ``d_outputs`` (after those of the hidden states, contexts, α and β) and ``sequence`` the
    forward's cells, gates, queries, alphas, contexts, betas, log_alphas and entropy."""
    if use_expected.dtype != torch.bool or locations.dtype != torch.int64:
        return None
    indices = (use_expected, locations)
    return _recurrence_backward(
        "hard",
        projected,
        annotations,
        hidden2,
        weight,
        gate,
        lstm,
        indices,
        sequence,
        d_outputs,
        grads,
    )


def _recurrence_backward(
    kind: str,
    projected: Tensor,
    annotations: Tensor,
    hidden2: Tensor,
    weight: Tensor,
    gate: Tensor | None,
    lstm: Tensor,
    indices: tuple[Tensor, ...],
    sequence: list[Tensor],
    d_outputs: list[Tensor],
    grads: list[Tensor],
) -> tuple[Tensor, Tensor] | None:
    d_outputs = [t.contiguous() for t in d_outputs]
    tensors = [projected, annotations, hidden2, weight, lstm, *sequence, *d_outputs, *grads]
    tensors += [] if gate is None else [gate]
    if (found := _recurrence_kernels(tensors, indices)) is None:
        return None
    kernels, sgemm = found
    T, B, _ = d_outputs[0].shape
    A, L, D = projected.size(1), projected.size(2), annotations.size(2)
    weight_rows = projected.new_empty(T, B, A)
    grad_projected = torch.empty_like(projected)
    scratch = [projected.new_empty(B, D + hidden2.size(1)), projected.new_empty(B, D)]
    scratch += [projected.new_empty(B, L)] if indices else []  # hard: ∂/∂ the scores
    pointers = [projected, annotations, hidden2, 2.0 * weight.reshape(-1), gate, lstm, *indices]
    pointers += [*sequence, *d_outputs, *grads, weight_rows, grad_projected, *scratch]
    function = getattr(kernels, f"{kind}_recurrence_backward")
    _call_recurrence(function, sgemm, pointers, T, projected, annotations, hidden2)
    return grad_projected, (2.0 * weight_rows.sum((0, 1))).view(1, A)
