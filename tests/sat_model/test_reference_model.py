"""The project's training step against a plain reference of the same equations.

The reference (``benchmarks/reference_model.py``, also what ``bench_model.py`` times the step
against) computes Eq. 1-7 step by step, unfused; the project's step must give the same loss and
the same gradient for every parameter, soft (Eq. 14) and hard (forced locations, so that both
take the same path s̃).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sat_model.config import HardTrainConfig, SoftTrainConfig
from sat_model.data.vocab import END_ID, PAD_ID, START_ID
from sat_model.model import fused as fused_module
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.losses import build_criterion

REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "reference_model.py"
B, L, D, K, A = 5, 9, 6, 15, 7


def _load_reference() -> object:
    spec = importlib.util.spec_from_file_location("reference_model", REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()


def _model(attention: str) -> ShowAttendTell:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=K,
        annotation_dim=D,
        num_locations=L,
        embed_dim=8,
        hidden_dim=10,
        attention_dim=A,
        dropout=0.0,
        gate=True,
        attention=attention,
        coordinates=True,
        grid_w=3,
        normalize_features=True,
    )
    model = ShowAttendTell(config).double()
    model.set_feature_statistics(torch.rand(D) + 0.5, torch.rand(D) + 0.5)
    return model.train()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Annotations (B, L, D), captions (B, T+1) of different lengths, locations (B, T)."""
    g = torch.Generator().manual_seed(1)
    annotations = 3 * torch.randn(B, L, D, generator=g, dtype=torch.float64)
    captions = torch.randint(END_ID + 1, K, (B, 8), generator=g)
    captions[:, 0] = START_ID
    for row, length in enumerate([7, 3, 5, 1, 6]):
        captions[row, length] = END_ID
        captions[row, length + 1 :] = PAD_ID
    locations = torch.randint(0, L, (B, 7), generator=g)
    return annotations, captions, locations


def _loss_and_grads(model: ShowAttendTell, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params)
    return {"loss": loss.detach(), **dict(zip(names, grads, strict=True))}


# one chunk for the whole batch, and two images per chunk (the last chunk ragged)
@pytest.mark.parametrize("chunk_elements", [1 << 18, 2 * A * L])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_training_step_gives_the_reference_loss_and_gradients(
    attention: str, chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_module, "SCORE_CHUNK_ELEMENTS", chunk_elements)
    model = _model(attention)
    annotations, captions, locations = _batch()
    forced = locations if attention == "hard" else None
    if attention == "soft":
        cfg = SoftTrainConfig(doubly_stochastic=1.0)
        ours = build_criterion("soft", cfg)(model(annotations, captions), captions).loss
        theirs = reference.reference_soft_loss(
            reference.reference_forward(model, annotations, captions), captions, 1.0
        )
    else:  # a fresh criterion each, so that both start from the same baseline
        cfg = HardTrainConfig()
        ours = build_criterion("hard", cfg)(
            model(annotations, captions, locations=forced), captions
        ).loss
        theirs = build_criterion("hard", cfg)(
            reference.reference_forward(model, annotations, captions, forced), captions
        ).loss
    expected = _loss_and_grads(model, theirs)
    got = _loss_and_grads(model, ours)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert value.abs().sum() > 0 or name == "loss", f"{name}: the reference gives no gradient"
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-11, msg=name)
