"""The fast backend against the readable model: the library's contract.

``decoder.py`` is the paper's equations through autograd; ``sat_model/model/kernels`` computes
the same functions faster. In float64 both must give the same loss and the same gradient for
every parameter (soft, Eq. 14; hard, the surrogate of Sec. 4.1, sampled with semi-sampling and
at forced locations), the same teacher-forced pass at test time, and the same decoding steps.
A model whose attention a researcher replaced must train through the readable code, with
autograd's gradients, and never reach the backend.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from sat_model.config import HardTrainConfig, ModelParams, SoftTrainConfig
from sat_model.data.vocab import END_ID, PAD_ID, START_ID
from sat_model.model.decoder import BACKEND_ENV, ShowAttendTell, SoftAttention
from sat_model.model.decoding import beam_search
from sat_model.model.factory import build_model
from sat_model.model.kernels import FastBackend, backend, native
from sat_model.model.losses import build_criterion
from tests.factories import model_config

B, L, D, K, A = 5, 9, 6, 15, 7


def _pair(
    attention: str, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> tuple[ShowAttendTell, ...]:
    """The same weights behind the fast backend and the readable code."""
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
    )
    fast = ShowAttendTell(config, backend="fast").to(dtype)
    fast.set_feature_statistics(torch.rand(D) + 0.5, torch.rand(D) + 0.5)
    readable = ShowAttendTell(config, backend="readable").to(dtype)
    readable.load_state_dict(fast.state_dict())
    return fast.to(device), readable.to(device)


def _batch(dtype: torch.dtype = torch.float64, device: str = "cpu") -> tuple[Tensor, ...]:
    """Annotations (B, L, D), captions (B, T+1) of different lengths, locations (B, T)."""
    g = torch.Generator().manual_seed(1)
    annotations = (3 * torch.randn(B, L, D, generator=g)).to(dtype)
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


@pytest.mark.parametrize(
    ("attention", "how"),
    [("soft", "train"), ("hard", "sampled"), ("hard", "forced"), ("hard", "expected")],
)
def test_the_backend_gives_the_readable_models_loss_and_gradients(attention: str, how: str) -> None:
    """Training (hard: s̃ drawn with semi-sampling, seeded alike so both draw the same s̃ and
    masks; or forced) and hard attention's expected path (what self-critical training
    fine-tunes), float64: the same loss and gradient for every parameter."""
    fast, readable = _pair(attention)
    kwargs: dict[str, Any] = {}
    if how == "forced":
        kwargs["locations"] = _batch()[2]
    if how == "expected":
        kwargs["mode"] = "expected"
    calls = fast.backend.calls if fast.backend is not None else -1
    want = _loss_and_grads(readable.train(), seed=2, **kwargs)
    got = _loss_and_grads(fast.train(), seed=2, **kwargs)
    assert fast.backend is not None and fast.backend.calls == calls + 1  # it took the pass
    assert readable.backend is None
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_the_backends_decoding_gives_the_readable_steps_and_captions(
    attention: str, dtype: torch.dtype
) -> None:
    """Decoding steps (float32: the compiled kernels where they build) and beam search."""
    fast, readable = (m.eval() for m in _pair(attention, dtype))
    annotations, captions, _ = _batch(dtype)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {}
    with torch.no_grad():
        states = [m.init_state(annotations) for m in (fast, readable)]
        for t in range(4):
            got, want = (
                m.step(captions[:, t], s) for m, s in zip((fast, readable), states, strict=True)
            )
            torch.testing.assert_close(got.logits, want.logits, **tol)
            torch.testing.assert_close(got.alpha, want.alpha, **tol)
            torch.testing.assert_close(got.beta, want.beta, **tol)
            if attention == "hard":
                torch.testing.assert_close(got.entropy, want.entropy, **tol)
            states = [got.state, want.state]
    assert fast.backend is not None and fast.backend.calls == 4
    got_beams = beam_search(fast, annotations, beam_size=3, max_length=8)
    want_beams = beam_search(readable, annotations, beam_size=3, max_length=8)
    assert [c.tokens for c in got_beams] == [c.tokens for c in want_beams]


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_on_a_gpu_the_stock_model_trains_and_decodes_through_the_readable_code(
    attention: str,
) -> None:
    """The backend computes on CPU tensors only (autograd through the equations measured
    faster on a GPU): there the stock model takes no fast pass and computes the readable
    model's loss, gradients and captions."""
    fast, readable = _pair(attention, device="cuda")
    kwargs = {"mode": "expected"} if attention == "hard" else {}
    want = _loss_and_grads(readable.train(), seed=2, **kwargs)
    got = _loss_and_grads(fast.train(), seed=2, **kwargs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
    annotations = _batch(device="cuda")[0]
    got_beams, want_beams = (beam_search(m, annotations, 3, 8) for m in (fast, readable))
    assert [c.tokens for c in got_beams] == [c.tokens for c in want_beams]
    assert fast.backend is not None and fast.backend.calls == 0


def test_off_the_cpu_the_backend_takes_no_pass() -> None:
    """On any other device (here PyTorch's shape-only ``meta`` tensors, where this machine has
    no GPU) the stock model's passes and steps are the readable code's."""
    fast, _ = _pair("soft", device="meta")
    annotations, captions, _ = _batch(device="meta")
    assert fast(annotations, captions).logits.device.type == "meta"
    state = fast.init_state(annotations)
    assert state.fast is None
    assert fast.backend is not None and fast.backend.calls == 0


class DotProductAttention(SoftAttention):
    """Luong's multiplicative scores in place of the paper's MLP: e_ti = (W_a a_i + b)·(W_h h)."""

    def scores(self, projected: Tensor, hidden: Tensor) -> Tensor:
        B, L, Adim = projected.shape
        query = self.hidden_proj(hidden).view(B, -1, Adim)  # (B, k, A)
        return torch.bmm(query, projected.transpose(1, 2)).view(-1, L)  # (B*k, L)


def _no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any use of the fused recurrence or the compiled kernels fail the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a fast kernel ran for a model with a replaced module")

    for name in ("recurrence", "FusedScores", "torch_lstm_step", "_blas_lstm_step"):
        monkeypatch.setattr(backend, name, refuse)
    monkeypatch.setattr(native, "load", refuse)


def test_a_replaced_attention_trains_through_autograd_and_no_fast_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast, _ = _pair("soft")
    fast.attention = DotProductAttention(D + 2, 10, A).double()
    assert fast.backend is not None and fast.fast is None  # the backend stands aside
    _no_kernels(monkeypatch)
    annotations, captions, _ = _batch()
    model = fast.train()
    criterion = build_criterion("soft", SoftTrainConfig(doubly_stochastic=0.0))

    # its gradients are autograd's: finite differences of the loss in the attention's weights
    names = [n for n, _ in model.named_parameters() if n.startswith("attention.")]
    params = dict(model.named_parameters())

    def loss_of(*values: Tensor) -> Tensor:
        new = {**params, **dict(zip(names, values, strict=True))}
        out = torch.func.functional_call(model, new, (annotations, captions))
        return criterion(out, captions).loss

    values = tuple(params[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(loss_of, values, eps=1e-6, atol=1e-5, fast_mode=True)

    # and it trains
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
    assert fast.backend.calls == 0


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
        cell = ForgetBiasCell(model.lstm.input_size, model.lstm.hidden_size).double()
        cell.load_state_dict(model.lstm.state_dict())
        model.lstm = cell
    _no_kernels(monkeypatch)
    got = fast.eval()(annotations, captions).logits
    torch.testing.assert_close(got, readable.eval()(annotations, captions).logits)
    assert not torch.allclose(got, stock_logits)  # the cell's own function was computed


def test_the_switch_picks_the_backend_once_by_param_then_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def built(**params: Any) -> ShowAttendTell:
        return build_model(
            ModelParams(**params), vocab_size=K, annotation_dim=D, num_locations=L, attention="soft"
        )

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(built().backend, FastBackend)  # the stock configuration takes it
    assert built(backend="readable").backend is None
    monkeypatch.setenv(BACKEND_ENV, "readable")
    assert built().backend is None
    assert isinstance(built(backend="fast").backend, FastBackend)  # the param wins
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="'triton'"):
        built()
