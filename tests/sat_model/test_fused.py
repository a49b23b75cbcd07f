"""The fused soft-attention recurrence (``sat_model.model.fused.soft_recurrence``).

Its backward is back-propagation through time written by hand, so it is checked against finite
differences of its own forward (``torch.autograd.gradcheck``, float64) for every input, the
annotations included; its forward against the step-by-step decoder (``ShowAttendTell.step``).
``test_reference_model.py`` checks the whole training loss and every parameter's gradient
against the plain reference of the paper's equations.
"""

from __future__ import annotations

import pytest
import torch

from sat_model.model import decoder, fused
from sat_model.model.fused import soft_recurrence
from tests.sat_model.test_model import tiny_batch, tiny_model

B, T, L, D, n, A = 3, 4, 5, 3, 4, 3


def _inputs(gate: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    return {
        "projected": rand(B, A, L),
        "annotations": rand(B, L, D),
        "h0": rand(B, n),
        "c0": rand(B, n),
        "input_gates": rand(T, B, 4 * n),
        "hidden_weight": rand(A, n),
        "score_weight": rand(1, A),
        "gate_weight": rand(1, n) if gate else None,
        "gate_bias": rand(1) if gate else None,
        "weight_z": rand(4 * n, D),
        "weight_h": rand(4 * n, n),
    }


@pytest.mark.parametrize("chunk_elements", [1 << 20, A * L])  # one chunk; one image per chunk
@pytest.mark.parametrize("gate", [True, False])
def test_soft_recurrence_gradients_match_finite_differences(
    gate: bool, chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "SCORE_CHUNK_ELEMENTS", chunk_elements)
    inputs = _inputs(gate)
    names = [k for k, v in inputs.items() if v is not None]

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = dict(inputs, **dict(zip(names, tensors, strict=True)))
        out = soft_recurrence(
            args.pop("projected"),
            args.pop("annotations"),
            args.pop("h0"),
            args.pop("c0"),
            args.pop("input_gates"),
            **args,
        )
        return out.hidden, out.context, out.alphas, out.betas

    assert torch.autograd.gradcheck(run, tuple(inputs[k] for k in names))


@pytest.mark.parametrize("gate", [True, False])
def test_soft_forward_gives_the_step_loops_outputs(gate: bool) -> None:
    model = tiny_model("soft", gate=gate).eval()
    annotations, captions = tiny_batch()
    out = model(annotations, captions)  # the fused recurrence
    state = model.init_state(annotations)
    for t in range(captions.shape[1] - 1):
        step = model.step(captions[:, t], state, "expected")
        torch.testing.assert_close(out.logits[:, t], step.logits)
        torch.testing.assert_close(out.alphas[:, t], step.alpha)
        torch.testing.assert_close(out.betas[:, t], step.beta)
        state = step.state


def test_only_soft_attention_without_autocast_takes_the_fused_recurrence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Autocast casts per op, hard attention samples per step, a forced location is per step:
    those keep the step loop; everything else of soft attention goes through one node."""
    calls: list[int] = []
    monkeypatch.setattr(
        decoder, "soft_recurrence", lambda *a, **k: calls.append(1) or soft_recurrence(*a, **k)
    )
    annotations, captions = tiny_batch()
    tiny_model("soft").train()(annotations, captions)
    tiny_model("soft").eval()(annotations, captions)
    assert len(calls) == 2
    tiny_model("soft")(annotations, captions, mode="sample")
    tiny_model("hard")(annotations, captions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiny_model("soft")(annotations, captions)
    assert len(calls) == 2
    assert torch.isfinite(out.logits).all()
