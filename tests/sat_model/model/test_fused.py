"""The fused training recurrence (``sat_model.model.kernels.fused.recurrence``), soft and hard.

Its backward is back-propagation through time written by hand, so it is checked against finite
differences of its own forward (``torch.autograd.gradcheck``, float64) for every input, the
annotations included, and its forward against the decoding steps. ``test_backend.py`` checks
the whole training loss and every parameter's gradient against the readable model.
"""

from __future__ import annotations

import pytest
import torch

from sat_model.model.kernels import backend, fused
from sat_model.model.kernels.fused import HardPath, recurrence
from tests.factories import tiny_batch, tiny_model

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


@pytest.mark.slow
@pytest.mark.parametrize("chunk_elements", [1 << 20, A * L])  # one chunk; one image per chunk
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_recurrence_gradients_match_finite_differences(
    attention: str, gate: bool, chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "SCORE_CHUNK_ELEMENTS", chunk_elements)
    inputs = _inputs(gate)
    names = [k for k, v in inputs.items() if v is not None]
    hard = None
    if attention == "hard":  # forced s̃ (a sample is not differentiable), image 1 semi-sampled
        g = torch.Generator().manual_seed(1)
        use_expected = torch.tensor([False, True, False])
        hard = HardPath(use_expected, torch.randint(0, L, (T, B), generator=g))

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = dict(inputs, **dict(zip(names, tensors, strict=True)))
        out = recurrence(
            args.pop("projected"),
            args.pop("annotations"),
            args.pop("h0"),
            args.pop("c0"),
            args.pop("input_gates"),
            **args,
            hard=hard,
        )
        if out.location_log_probs is None or out.entropy is None:
            return out.hidden, out.context, out.alphas, out.betas
        return out.hidden, out.context, out.alphas, out.betas, out.location_log_probs, out.entropy

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


def test_training_passes_without_autocast_take_the_fused_recurrence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Soft attention (train or expected) and hard attention in training or with its expected
    context (self-critical training) go through one node; the sampled and argmax modes and
    autocast (which casts per op) run the readable step loop."""
    calls: list[int] = []
    monkeypatch.setattr(
        backend, "recurrence", lambda *a, **k: calls.append(1) or recurrence(*a, **k)
    )
    annotations, captions = tiny_batch()
    tiny_model("soft").train()(annotations, captions)
    tiny_model("soft").eval()(annotations, captions)
    tiny_model("hard").train()(annotations, captions)
    tiny_model("hard").eval()(annotations, captions)
    assert len(calls) == 4
    tiny_model("soft")(annotations, captions, mode="sample")
    tiny_model("hard")(annotations, captions, mode="argmax")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiny_model("soft")(annotations, captions)
    assert len(calls) == 4
    assert torch.isfinite(out.logits).all()


def test_scores_are_chunked_for_the_cpu_cache() -> None:
    images, per_image = 64, 512 * 196  # the tutorial's A x L: ~100 k elements an image
    chunks = fused.score_chunks(images, per_image)
    # contiguous ranges covering every image, each within SCORE_CHUNK_ELEMENTS
    assert [b0 for b0, _ in chunks] == [0] + [b1 for _, b1 in chunks[:-1]]
    assert chunks[-1][1] == images and len(chunks) == 7
    assert all((b1 - b0) * per_image <= fused.SCORE_CHUNK_ELEMENTS for b0, b1 in chunks)
