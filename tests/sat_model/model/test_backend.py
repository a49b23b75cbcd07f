"""The native backend against the readable model: the library's contract.

``decoder.py`` is the paper's equations through autograd; ``sat_model/model/kernels`` computes
a training pass on compiled kernels (float32 CPU tensors). Both must give the same loss and
the same gradient for every parameter (soft, Eq. 14; hard, the surrogate of Sec. 4.1 at forced
locations and on its expected path), up to float32 rounding; decoding is the readable code's.
A model whose attention or cell a researcher replaced, a tensor off the CPU and autocast run
the readable code. The path is a param: ``model.backend`` in params.yaml, part of a
training run's identity (``tests/pipeline/test_run_identity.py``), since the two paths draw
hard attention's s̃ and round differently; no environment variable changes it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from torch import Tensor, nn

import sat_model.model
from sat_model.config import HardTrainConfig, ModelParams, SoftTrainConfig
from sat_model.data.vocab import END_ID, PAD_ID, START_ID
from sat_model.model.decoder import ShowAttendTell, SoftAttention
from sat_model.model.decoding import beam_search
from sat_model.model.factory import build_model
from sat_model.model.kernels import NativeBackend, backend, build_backend, native
from sat_model.model.losses import build_criterion
from sat_model.model.outputs import DecoderState
from tests.factories import model_config

B, L, D, K, A = 5, 9, 6, 15, 7
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # float32, the kernels' exponential within 1 ulp
MODEL_PACKAGE = Path(sat_model.model.__file__).parent


def _pair(attention: str, device: str = "cpu", dropout: float = 0.0) -> tuple[ShowAttendTell, ...]:
    """The same weights behind the native backend and the readable code."""
    torch.manual_seed(0)
    config = model_config(
        vocab_size=K,
        annotation_dim=D,
        num_locations=L,
        hidden_dim=10,
        attention_dim=A,
        attention=attention,
        coordinates=True,
        grid_w=3,
        normalize_features=True,
        dropout=dropout,
    )
    fast = ShowAttendTell(config, build_backend("native"))
    fast.set_feature_statistics(torch.rand(D) + 0.5, torch.rand(D) + 0.5)
    readable = ShowAttendTell(config, build_backend("readable"))
    readable.load_state_dict(fast.state_dict())
    return fast.to(device), readable.to(device)


def _batch(device: str = "cpu") -> tuple[Tensor, ...]:
    """Annotations (B, L, D), captions (B, T+1) of different lengths, locations (B, T)."""
    g = torch.Generator().manual_seed(1)
    annotations = 3 * torch.randn(B, L, D, generator=g)
    captions = torch.randint(END_ID + 1, K, (B, 8), generator=g)
    captions[:, 0] = START_ID
    for row, length in enumerate([7, 3, 5, 1, 6]):
        captions[row, length] = END_ID
        captions[row, length + 1 :] = PAD_ID
    locations = torch.randint(0, L, (B, 7), generator=g)
    return tuple(t.to(device) for t in (annotations, captions, locations))


def _loss_and_grads(model: ShowAttendTell, seed: int, **kwargs: Any) -> dict[str, Tensor]:
    device = next(model.parameters()).device
    annotations, captions, _ = _batch(device=device.type)
    attention = model.config.attention
    cfg = SoftTrainConfig(doubly_stochastic=1.0) if attention == "soft" else HardTrainConfig()
    criterion = build_criterion(attention, cfg).to(device)  # hard's baseline b is a buffer
    torch.manual_seed(seed)
    loss = criterion(model(annotations, captions, **kwargs), captions).loss
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params)
    return {"loss": loss.detach(), **dict(zip(names, grads, strict=True))}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the kernels' recurrence."""
    calls: list[int] = []
    function = backend.recurrence
    monkeypatch.setattr(backend, "recurrence", lambda *a: calls.append(1) or function(*a))
    return calls


@pytest.mark.parametrize(
    ("attention", "how"),
    [("soft", "train"), ("soft", "dropout"), ("hard", "forced"), ("hard", "expected")],
)
def test_the_backend_gives_the_readable_models_loss_and_gradients(
    attention: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training (hard: at forced locations) and hard attention's expected path (what
    self-critical training fine-tunes): the same loss and gradient for every parameter; with
    dropout before L_o both draw the same mask from the same seed."""
    fast, readable = _pair(attention, dropout=0.5 if how == "dropout" else 0.0)
    kwargs: dict[str, Any] = {}
    if how == "forced":
        kwargs["locations"] = _batch()[2]
    if how == "expected":
        kwargs["mode"] = "expected"
    calls = _spy(monkeypatch)
    want = _loss_and_grads(readable.train(), seed=2, **kwargs)
    assert not calls
    got = _loss_and_grads(fast.train(), seed=2, **kwargs)
    assert calls == [1]  # the backend took the pass
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOLERANCE, msg=name)


def test_hard_attentions_sampled_training_takes_the_kernels_and_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """s̃ drawn inside the recurrence: the path differs from the readable one in its draws,
    so only its shape of result is held here; each image's s̃ is one of its locations."""
    fast, _ = _pair("hard")
    calls = _spy(monkeypatch)
    annotations, captions, _ = _batch()
    out = fast.train()(annotations, captions)
    assert calls == [1] and out.sampled is not None and out.location_log_probs is not None
    assert torch.isfinite(out.location_log_probs).all() and (out.location_log_probs <= 0).all()


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_decoding_runs_the_readable_steps_and_captions(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding steps and beam search: the readable code's (no kernel paid for itself there)."""
    fast, readable = (m.eval() for m in _pair(attention))
    annotations, captions, _ = _batch()
    _no_kernels(monkeypatch)
    with torch.no_grad():
        states = [m.init_state(annotations) for m in (fast, readable)]
        for t in range(4):
            got, want = (
                m.step(captions[:, t], s) for m, s in zip((fast, readable), states, strict=True)
            )
            for field in ("logits", "alpha", "beta", "entropy"):
                torch.testing.assert_close(getattr(got, field), getattr(want, field), **TOLERANCE)
            states = [got.state, want.state]
    got_beams = beam_search(fast, annotations, beam_size=3, max_length=8)
    want_beams = beam_search(readable, annotations, beam_size=3, max_length=8)
    assert [c.tokens for c in got_beams] == [c.tokens for c in want_beams]


@pytest.mark.slow
@pytest.mark.parametrize(("attention", "mode"), [("soft", "expected"), ("hard", "argmax")])
def test_compiled_decoding_gives_the_readable_captions(
    attention: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile_decoding``: every step of a beam search through ``torch.compile`` of the
    readable step, and the same captions, scores and α as the readable code."""
    fast, readable = (m.eval() for m in _pair(attention))
    fast.backend = build_backend("native", compile_decoding=True)
    compiled_calls = []

    def counted(step: Any) -> Any:
        compiled_calls.append(step)
        return compiled_step(step)

    compiled_step, readable_step = backend._compiled_step, readable.step
    monkeypatch.setattr(backend, "_compiled_step", counted)
    readable_steps = []
    monkeypatch.setattr(readable, "step", lambda *a: readable_steps.append(1) or readable_step(*a))
    annotations = _batch()[0]
    got, want = (beam_search(m, annotations, 3, 8, mode=mode) for m in (fast, readable))
    assert len(compiled_calls) == len(readable_steps) > 1  # every step compiled
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.score == pytest.approx(w.score, rel=1e-5)
        np.testing.assert_allclose(g.alphas, w.alphas, rtol=1e-4, atol=1e-6)
    # where torch.compile runs the function as it is (disabled, or past its recompile limit)
    with torch._dynamo.config.patch(disable=True):
        got = beam_search(fast, annotations, 3, 8, mode=mode)
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_compiled_decoding_declines_where_the_compiled_step_would_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that draws a location, one under autograd and one off the CPU run the readable
    code: the compiled code draws from another random stream, and compiling for a training
    step or a GPU was never measured to pay."""
    fast, readable = _pair("hard")
    fast.backend = build_backend("native", compile_decoding=True)
    monkeypatch.setattr(backend, "_compiled_step", _never)
    annotations, captions, _ = _batch()
    sampled = []
    for m in (fast, readable):
        torch.manual_seed(3)
        with torch.no_grad():
            sampled.append(m.step(captions[:, 0], m.init_state(annotations), "sample").location)
    assert sampled[0] is not None and torch.equal(sampled[0], sampled[1])
    fast.step(captions[:, 0], fast.init_state(annotations))  # autograd on
    meta = _pair("soft", device="meta")[0]
    meta.backend = fast.backend
    with torch.no_grad():
        meta.step(captions[:, 0].to("meta"), meta.init_state(_batch(device="meta")[0]))


def _never(step: Any) -> Any:
    raise AssertionError("the compiled step was asked for")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_on_a_gpu_the_stock_model_trains_and_decodes_through_the_readable_code(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, readable = _pair(attention, device="cuda")
    _no_kernels(monkeypatch)
    kwargs = {"mode": "expected"} if attention == "hard" else {}
    want = _loss_and_grads(readable.train(), seed=2, **kwargs)
    got = _loss_and_grads(fast.train(), seed=2, **kwargs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    annotations = _batch(device="cuda")[0]
    got_beams, want_beams = (beam_search(m, annotations, 3, 8) for m in (fast, readable))
    assert [c.tokens for c in got_beams] == [c.tokens for c in want_beams]


def test_off_the_cpu_and_under_autocast_the_backend_takes_no_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On any other device (here PyTorch's shape-only ``meta`` tensors, where this machine has
    no GPU), in another dtype, or under autocast, the passes and steps are the readable code's."""
    fast, _ = _pair("soft", device="meta")
    annotations, captions, _ = _batch(device="meta")
    _no_kernels(monkeypatch)
    assert fast(annotations, captions).logits.device.type == "meta"
    with torch.no_grad():
        fast.step(captions[:, 0], fast.init_state(annotations))
    fast, _ = _pair("soft")
    annotations, captions, _ = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast(annotations, captions)
    fast.double()(annotations.double(), captions)


class DotProductAttention(SoftAttention):
    """Luong's multiplicative scores in place of the paper's MLP: e_ti = (W_a a_i + b)·(W_h h)."""

    def scores(self, projected: Tensor, hidden: Tensor) -> Tensor:
        B, L, Adim = projected.shape
        query = self.hidden_proj(hidden).view(B, -1, Adim)  # (B, k, A)
        return torch.bmm(query, projected.transpose(1, 2)).view(-1, L)  # (B*k, L)


def _no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any use of the recurrence or the compiled kernels fail the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel ran where the readable code should")

    monkeypatch.setattr(backend, "recurrence", refuse)
    monkeypatch.setattr(native, "load", refuse)


def test_a_replaced_attention_trains_through_autograd_and_no_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast, _ = _pair("soft")
    fast.attention = DotProductAttention(D + 2, 10, A)
    _no_kernels(monkeypatch)
    annotations, captions, _ = _batch()
    model = fast.train()
    criterion = build_criterion("soft", SoftTrainConfig(doubly_stochastic=0.0))
    optimiser = torch.optim.Adam(model.parameters(), lr=0.03)
    losses = []
    for _ in range(40):
        loss = criterion(model(annotations, captions), captions).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        beam_search(model.eval(), annotations, beam_size=2, max_length=6)


class ForgetBiasCell(nn.LSTMCell):
    """A user's cell: nn.LSTMCell with one added to its forget gate's pre-activation."""

    def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        assert hx is not None
        h, c = hx
        gates = x @ self.weight_ih.t() + self.bias_ih + h @ self.weight_hh.t() + self.bias_hh
        i, f, g, o = gates.chunk(4, dim=1)  # (rows, n) each, nn.LSTMCell's order
        c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


def test_a_subclassed_cell_runs_the_readable_code_and_is_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backend computes nn.LSTMCell's function: a subclass must not get it."""
    annotations, captions, _ = _batch()
    stock, _ = _pair("soft")
    stock_logits = stock.eval()(annotations, captions).logits
    fast, readable = _pair("soft")
    for model in (fast, readable):
        cell = ForgetBiasCell(model.lstm.input_size, model.lstm.hidden_size)
        cell.load_state_dict(model.lstm.state_dict())
        model.lstm = cell
    _no_kernels(monkeypatch)
    got = fast.eval()(annotations, captions).logits
    torch.testing.assert_close(got, readable.eval()(annotations, captions).logits)
    assert not torch.allclose(got, stock_logits)  # the cell's own function was computed


def test_the_param_alone_picks_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.backend``, injected by the factory; the old environment variable does nothing."""

    def built(**params: Any) -> ShowAttendTell:
        return build_model(
            ModelParams(**params), vocab_size=K, annotation_dim=D, num_locations=L, attention="soft"
        )

    monkeypatch.setenv("SAT_MODEL_BACKEND", "readable")
    assert isinstance(built().backend, NativeBackend)  # the default
    assert built(backend="readable").backend is None
    with pytest.raises(pydantic.ValidationError, match="backend"):
        built(backend="fast")
    assert "backend" not in {f.name for f in DecoderState.__dataclass_fields__.values()}
    assert not any("SAT_MODEL_BACKEND" in p.read_text() for p in MODEL_PACKAGE.rglob("*.py"))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ``sat_model.model`` modules ``path`` imports anywhere: at the top, inside functions
    and under ``TYPE_CHECKING``, as a reader finds them (``from package import module`` names
    the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= (names & modules) or {node.module}
    return found & modules


def test_the_model_package_has_no_import_cycle_and_the_decoder_names_no_kernel() -> None:
    modules = {}
    for path in MODEL_PACKAGE.rglob("*.py"):
        parts = path.relative_to(MODEL_PACKAGE.parent.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    assert "sat_model.model.kernels.native" in graph["sat_model.model.kernels.backend"]
    cycles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not cycles, f"import cycles through {cycles}"
    decoder = (MODEL_PACKAGE / "decoder.py").read_text(encoding="utf-8")
    assert "kernels" not in decoder


def test_training_without_the_kernels_fails_with_the_param_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No compiler: the native path cannot train (its weights would be the readable path's,
    under a run identity that says native), so it says what to change; decoding, which
    changes no weights, runs the readable code."""
    monkeypatch.setattr(native, "load", lambda: None)
    fast, readable = _pair("soft")
    annotations, captions, _ = _batch()
    with pytest.raises(RuntimeError, match=r"model\.backend: readable"):
        fast.train()(annotations, captions)
    with torch.no_grad():
        got = beam_search(fast.eval(), annotations, beam_size=2, max_length=5)
    assert [c.tokens for c in got] == [
        c.tokens for c in beam_search(readable.eval(), annotations, beam_size=2, max_length=5)
    ]
