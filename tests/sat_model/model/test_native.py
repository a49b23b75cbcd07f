"""The compiled attention-score kernels (``sat_model.model.native``) and their fallback.

The kernels are checked against the PyTorch code of ``fused.py`` in float64 (which never takes
them), a whole training step against the same step with the kernels off, and the build: where
there is a compiler it builds, a broken or missing one leaves one warning and the PyTorch code,
the cache is reused, and loading the library leaves the process's float mode alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sat_model.config import HardTrainConfig, SoftTrainConfig
from sat_model.model.kernels import fused, native
from sat_model.model.losses import build_criterion
from tests.factories import tiny_batch, tiny_model

HAS_COMPILER = shutil.which(os.environ.get("CXX") or "c++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH")


KERNEL_ENTRIES = (
    "scores_forward",
    "scores_backward",
    "attend_forward",
    "attend_backward",
    "lstm_forward",
    "lstm_backward",
    "soft_recurrence_forward",
    "soft_recurrence_backward",
    "hard_recurrence_forward",
    "hard_recurrence_backward",
)
# which kernels a training step runs: the T steps in one call each way, or, where torch exports
# no BLAS, step by step: soft attention's whole step, hard attention's scores, and the LSTM's
EXPECTED_CALLS = {
    "soft": {"soft_recurrence_forward", "soft_recurrence_backward"},
    "soft-step-by-step": {"attend_forward", "attend_backward", "lstm_forward", "lstm_backward"},
    "hard": {"hard_recurrence_forward", "hard_recurrence_backward"},
    "hard-step-by-step": {"scores_forward", "scores_backward", "lstm_forward", "lstm_backward"},
}


def _recording(function: Callable[..., Any], name: str, calls: set[str]) -> Callable[..., Any]:
    def record(*args: Any) -> Any:
        result = function(*args)
        if result is not None and result is not False:
            calls.add(name)
        return result

    return record


@pytest.fixture(autouse=True)
def fresh_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test loads (or refuses) the kernels under its own environment."""
    native.load.cache_clear()
    yield
    native.load.cache_clear()


def _scores_inputs(B: int, k: int, A: int, L: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(B * 100 + k * 10 + L)
    projected = 2.0 * torch.randn(B, A, L, generator=g)
    query = torch.randn(B * k, A, generator=g)
    weight = torch.randn(1, A, generator=g)
    grad = torch.randn(B * k, L, generator=g)
    return projected, query, weight, grad


@pytest.mark.slow
@needs_compiler
def test_the_kernels_build_where_there_is_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.load() is not None
    built = list(native.cache_dir().glob("sat_kernels_*/sat_kernels_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.load.cache_clear()  # a second load: the built library, not a second build
    assert native.load() is not None
    assert [p.stat().st_mtime_ns for p in native.cache_dir().glob("*/*.so")] == [stamp]


@needs_compiler
@pytest.mark.parametrize(("k", "L"), [(1, 196), (3, 196), (2, 37)])  # beams; a ragged length
def test_native_scores_match_pytorch_in_float64(k: int, L: int) -> None:
    B, A = 5, 32
    projected, query, weight, grad = _scores_inputs(B, k, A, L)
    assert native.load() is not None
    want = fused.fused_scores(projected.double(), query.double(), weight.double())
    got = native.scores_forward(projected, query, weight)
    assert got is not None and got.shape == (B * k, L)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    double = [t.double() for t in (grad, projected, query, weight)]
    want_p, want_q, want_w = fused.fused_scores_backward(*double, True, None)
    assert want_p is not None
    result = native.scores_backward(grad, projected, query, weight, None)
    assert result is not None
    got_p, got_q, got_w = result
    torch.testing.assert_close(got_p.double(), want_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_q.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w.double(), want_w, rtol=1e-5, atol=1e-4)

    # a second step's gradient adds into the first's, as the recurrence's sink sums them
    held = got_p.clone()
    result = native.scores_backward(grad, projected, query, weight, held)
    assert result is not None and result[0] is held
    torch.testing.assert_close(held.double(), 2 * want_p, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize(
    ("path", "gate"),
    [
        ("soft", True),
        ("soft", False),
        ("soft-step-by-step", True),
        ("hard", True),
        ("hard", False),
        ("hard-step-by-step", True),
    ],
)
def test_a_training_step_with_the_kernels_matches_one_without(
    path: str, gate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32, the recurrence through the kernels against the same step in PyTorch's ops:
    the same loss and gradients to float32 rounding (the hard model samples the same s̃)."""
    attention = path.split("-")[0]
    model = tiny_model(attention, attention_dim=16, gate=gate).train()
    annotations, captions = tiny_batch()
    cfg = SoftTrainConfig(doubly_stochastic=1.0) if attention == "soft" else HardTrainConfig()
    if path.endswith("step-by-step"):  # a torch build that exports no sgemm_
        monkeypatch.setattr(native, "_sgemm", lambda: None)
    calls: set[str] = set()
    for name in KERNEL_ENTRIES:
        monkeypatch.setattr(native, name, _recording(getattr(native, name), name, calls))
    # the same weights through the fused backend: the fast one's code without the kernels
    without = tiny_model(attention, "fused", attention_dim=16, gate=gate).train()
    without.load_state_dict(model.state_dict())
    results = []
    for each, want_calls in ((model, EXPECTED_CALLS[path]), (without, set())):
        calls.clear()
        torch.manual_seed(2)  # the hard model's semi-sampling then picks s̃ for 2 images of 4
        out = each(annotations, captions)
        if out.sampled is not None:  # some images follow s̃, some α (semi-sampling)
            assert 0 < int(out.sampled.sum()) < len(out.sampled)
        loss = build_criterion(attention, cfg)(out, captions).loss
        results.append((loss, torch.autograd.grad(loss, list(each.parameters()))))
        assert calls == want_calls  # forward and backward
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-6)
    for (name, _), got, want in zip(model.named_parameters(), grads_on, grads_off, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("compiler", ["no-such-compiler-here", "false"])
def test_no_usable_compiler_leaves_one_warning_and_the_pytorch_code(
    compiler: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Missing (not on PATH) or broken (``false`` exits 1): one warning line, and the scores
    come from PyTorch's ops, the same numbers."""
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command on PATH")
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    projected, query, weight, _ = _scores_inputs(4, 1, 8, 20)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None
        assert native.load() is None  # once per process
        scores = fused.fused_scores(projected, query, weight)
    [record] = caplog.records
    assert "PyTorch" in record.getMessage() and "\n" not in record.getMessage()
    want = fused.fused_scores(projected.double(), query.double(), weight.double())
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chosen_by", ["argument", "environment"])
def test_the_fused_backend_runs_without_the_kernels_and_says_nothing(
    chosen_by: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``fused`` (the one switch, as an argument or ``SAT_MODEL_BACKEND``): training and
    decoding through the backend's PyTorch code, no build tried, no warning, even with no
    compiler to be had."""
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    if chosen_by == "environment":
        monkeypatch.setenv("SAT_MODEL_BACKEND", "fused")
    model = tiny_model("soft", "fused" if chosen_by == "argument" else None)
    assert model.backend is not None and not model.backend.native
    annotations, captions = tiny_batch()
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        loss = model(annotations, captions).logits.sum()
        loss.backward()
        with torch.inference_mode():
            model.eval()
            state = model.init_state(annotations)
            model.step(captions[:, 0], state)
    assert model.backend.calls == 2  # the training pass and the decoding step: its own code
    assert native.load.cache_info().currsize == 0  # never asked for the kernels
    assert not caplog.records


@pytest.mark.slow
@needs_compiler
def test_loading_the_library_keeps_subnormal_floats() -> None:
    """-ffast-math at link time would add crtfastmath, which turns on flush-to-zero for the
    whole process when the library loads; the kernels are compiled with it and linked
    without it."""
    assert native.load() is not None
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in float32
    assert float(tiny * 0.5) > 0.0


@needs_compiler
def test_native_lstm_cell_matches_autograd_in_float64() -> None:
    """Eq. 1-3 after the gates' product, forward and backward, against PyTorch's autograd of
    the same equations in float64; h_t also lands in the next step's strided input rows."""
    B, n, D = 5, 24, 7
    g = torch.Generator().manual_seed(0)
    pre, cell_prev = torch.randn(B, 4 * n, generator=g), torch.randn(B, n, generator=g)
    grad_later, grad_output, grad_cell = (torch.randn(B, n, generator=g) for _ in range(3))

    pre64 = pre.double().requires_grad_()
    cell_prev64 = cell_prev.double().requires_grad_()
    i, f, gg, o = pre64.chunk(4, dim=1)
    c64 = i.sigmoid() * gg.tanh() + f.sigmoid() * cell_prev64
    h64 = o.sigmoid() * c64.tanh()
    loss = (h64 * (grad_later + grad_output).double()).sum() + (c64 * grad_cell.double()).sum()
    want_pre, want_cell_prev = torch.autograd.grad(loss, [pre64, cell_prev64])

    gates, cell, hidden = pre.clone(), torch.empty(B, n), torch.empty(B, n)
    next_rows = torch.zeros(B, D + n)
    assert native.lstm_forward(gates, cell_prev, cell, hidden, next_rows[:, D:])
    torch.testing.assert_close(cell.double(), c64.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.double(), h64.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(next_rows[:, D:], hidden) and not next_rows[:, :D].any()

    grad_gates, grad_cell_io = torch.empty(B, 4 * n), grad_cell.clone()
    assert native.lstm_backward(
        gates, cell_prev, cell, grad_later, grad_output, grad_cell_io, grad_gates
    )
    torch.testing.assert_close(grad_gates.double(), want_pre, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_cell_io.double(), want_cell_prev, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("k", [1, 3])
def test_native_attention_step_matches_pytorch_in_float64(k: int) -> None:
    """Scores, softmax and Σ α a of the k rows of each image in one kernel, against PyTorch's
    ops in float64; the context lands in rows of a wider buffer (the LSTM's input)."""
    B, A, L, D = 4, 16, 49, 9
    projected, query, weight, _ = _scores_inputs(B, k, A, L)
    annotations = torch.randn(B, L, D, generator=torch.Generator().manual_seed(5))
    scores64 = fused.fused_scores(projected.double(), query.double(), weight.double())
    alpha64 = torch.softmax(scores64, dim=-1)
    context64 = fused.expected_context(annotations.double(), alpha64)

    alpha, wide = torch.empty(B * k, L), torch.zeros(B * k, D + 5)
    assert native.attend_forward(projected, query, weight, annotations, alpha, wide[:, :D])
    torch.testing.assert_close(alpha.double(), alpha64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wide[:, :D].double(), context64, rtol=1e-5, atol=1e-6)
    assert not wide[:, D:].any()


@needs_compiler
@pytest.mark.parametrize("k", [1, 3, 5])
def test_decoding_attention_from_exp_of_projected_matches_pytorch_in_float64(k: int) -> None:
    """Decoding's form of the step, σ(p + q) = 1 / (1 + e^{-p} e^{-q}) with e^{-p} computed
    once per image: the same α and context as PyTorch's ops in float64. An image with a query
    beyond the bound (one of its rows at 60) takes the exact form for its rows, the others the
    fast one, in the same call."""
    B, A, L, D = 4, 16, 49, 9
    projected, query, weight, _ = _scores_inputs(B, k, A, L)
    query[k, 3] = 60.0  # image 1's first row: e^{-60} is beyond the product's bound
    annotations = torch.randn(B, L, D, generator=torch.Generator().manual_seed(5))
    alpha64 = torch.softmax(
        fused.fused_scores(projected.double(), query.double(), weight.double()), dim=-1
    )
    context64 = fused.expected_context(annotations.double(), alpha64)

    exp_projected = native.exp_of_projected(projected)
    assert exp_projected is not None
    alpha, context = torch.empty(B * k, L), torch.empty(B * k, D)
    assert native.attend_forward(
        projected, query, weight, annotations, alpha, context, exp_projected
    )
    torch.testing.assert_close(alpha.double(), alpha64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(context.double(), context64, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("far", [60.0, 211.0, 1e4])
def test_projections_far_out_give_the_exact_scores_from_exp_of_projected(far: float) -> None:
    """Trained models have projections |p| up to ~200 (the Flickr8k profile's): e^{-p} is
    taken of p clamped to ±PROJECTED_CLAMP, which keeps e^{-p} e^{-q} finite in the fast-math
    loops for queries within ±QUERY_BOUND and changes α by less than float64 can tell apart at
    the test's tolerance, at either end and with queries at the bound."""
    B, A, L, D = 2, 8, 49, 5
    g = torch.Generator().manual_seed(3)
    projected = 3.0 * torch.randn(B, A, L, generator=g)
    projected[:, :, :10] = far
    projected[:, :, 10:20] = -far
    query = torch.full((B, A), native.QUERY_BOUND)
    query[:, ::2] = -native.QUERY_BOUND
    weight, annotations = torch.randn(1, A, generator=g), torch.randn(B, L, D, generator=g)
    alpha64 = torch.softmax(
        fused.fused_scores(projected.double(), query.double(), weight.double()), dim=-1
    )
    exp_projected = native.exp_of_projected(projected)
    assert exp_projected is not None and torch.isfinite(exp_projected).all()
    alpha, context = torch.empty(B, L), torch.empty(B, D)
    assert native.attend_forward(
        projected, query, weight, annotations, alpha, context, exp_projected
    )
    torch.testing.assert_close(alpha.double(), alpha64, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(context).all()


@needs_compiler
@pytest.mark.parametrize("with_grad_alpha", [True, False])
def test_native_attention_backward_matches_autograd_in_float64(with_grad_alpha: bool) -> None:
    """From ∂/∂φ and the loss's ∂/∂α to the gradients for P, q and w_att, against autograd
    through the same step in float64; a second call adds into the first's ∂/∂P."""
    B, A, L, D = 4, 16, 49, 9
    projected, query, weight, _ = _scores_inputs(B, 1, A, L)
    g = torch.Generator().manual_seed(6)
    annotations = torch.randn(B, L, D, generator=g)
    grad_context, grad_alpha = torch.randn(B, D, generator=g), torch.randn(B, L, generator=g)

    leaves = [t.double().requires_grad_() for t in (projected, query, weight)]
    projected64, query64, weight64 = leaves
    sig = torch.sigmoid(projected64 + query64.unsqueeze(2))  # (B, A, L)
    alpha64 = torch.softmax(2.0 * (weight64.view(1, A, 1) * sig).sum(1), dim=-1)
    context64 = fused.expected_context(annotations.double(), alpha64)
    loss = (context64 * grad_context.double()).sum()
    if with_grad_alpha:
        loss = loss + (alpha64 * grad_alpha.double()).sum()
    want_p, want_q, want_w = torch.autograd.grad(loss, leaves)

    alpha, context = torch.empty(B, L), torch.empty(B, D)
    assert native.attend_forward(projected, query, weight, annotations, alpha, context)
    grad_query = torch.empty(B, A)
    args = (grad_context, grad_alpha if with_grad_alpha else None, alpha, annotations)
    result = native.attend_backward(*args, projected, query, weight, None, grad_query)
    assert result is not None
    got_p, got_w = result
    torch.testing.assert_close(got_p.double(), want_p, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_query.double(), want_q, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got_w.double(), want_w, rtol=1e-4, atol=1e-5)
    again = native.attend_backward(*args, projected, query, weight, got_p, grad_query)
    assert again is not None and again[0] is got_p
    torch.testing.assert_close(got_p.double(), 2 * want_p, rtol=1e-4, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("value", [-1e4, -100.0, 100.0])
def test_saturated_inputs_give_finite_values(value: float) -> None:
    """σ and tanh far out on either side (a hard-attention run reached pre-activations below
    -88, where e^{-x} overflows float32, and under -ffast-math 1 / (1 + inf) came out NaN):
    every kernel stays finite and equal to float64's saturated values."""
    B, A, L, D, n = 2, 8, 49, 5, 6
    projected = torch.full((B, A, L), value)
    projected[:, :, 0] = 0.0  # one location not saturated
    query, weight = torch.zeros(B, A), torch.ones(1, A)
    grad, annotations = torch.ones(B, L), torch.randn(B, L, D)
    want_scores = fused.fused_scores(projected.double(), query.double(), weight.double())
    want_grads = fused.fused_scores_backward(
        grad.double(), projected.double(), query.double(), weight.double(), True, None
    )
    scores = native.scores_forward(projected, query, weight)
    grads = native.scores_backward(grad, projected, query, weight, None)
    assert scores is not None and grads is not None
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        assert want is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    alpha, context = torch.empty(B, L), torch.empty(B, D)
    assert native.attend_forward(projected, query, weight, annotations, alpha, context)
    assert torch.isfinite(alpha).all() and torch.isfinite(context).all()

    gates, cell_prev = torch.full((B, 4 * n), value), torch.ones(B, n)
    cell, hidden = torch.empty(B, n), torch.empty(B, n)
    want_gates = torch.cat([torch.full((B, n), value).double().sigmoid()] * 2, dim=1)
    assert native.lstm_forward(gates, cell_prev, cell, hidden, None)
    torch.testing.assert_close(gates[:, : 2 * n].double(), want_gates, rtol=0.0, atol=1e-6)
    assert torch.isfinite(cell).all() and torch.isfinite(hidden).all()


@pytest.mark.slow
@needs_compiler
def test_processes_building_at_once_share_one_library(tmp_path: Path) -> None:
    """Three processes with an empty cache load the kernels at the same moment (Ray workers
    starting together): each gets a working library, and the cache holds one (cpp_extension's
    lock makes the others wait for the first build)."""
    script = (
        "import torch; from sat_model.model.kernels import native\n"
        "assert native.load() is not None\n"
        "p, q, w = torch.randn(2, 4, 9), torch.randn(2, 4), torch.randn(1, 4)\n"
        "assert native.scores_forward(p, q, w) is not None\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    [folder] = (tmp_path / "sat" / "kernels").iterdir()  # one build for this CPU
    libraries = list(folder.glob("*.so"))
    assert len(libraries) == 1 and libraries[0].name.startswith("sat_kernels_"), libraries
