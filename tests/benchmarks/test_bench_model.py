"""``benchmarks/bench_model.py``: its beam search rows (batched against one image at a time in
float32 and in bfloat16, and the bound the matrix products put on their ratio), its plain
reference of the training step, the baseline tree and the compiled decoding step it times
beside this one, and the kept kernels against compiled readable code."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from sat_model.config import SoftTrainConfig
from sat_model.data.vocab import PAD_ID
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.losses import build_criterion
from tests.factories import ROOT, model_config

BENCHMARKS = ROOT / "benchmarks"


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench_model = _load("bench_model")
TINY = bench_model.Dims("tiny", L=4, D=8, m=8, n=16, A=8, K=12)


def test_float32_row_has_the_same_captions_both_ways() -> None:
    row = bench_model.bench_beam(TINY, images=4, beam=3, max_length=5, rounds=1)
    assert row["dtype"] == "float32" and row["same_captions"] is True
    assert "images_with_the_float32_caption" not in row
    # 4 images: one row each at the first step, then 3 rows for each of the 4 later steps
    assert row["batched_matmul_flops"] == 4 * (1 + 3 * 4) * bench_model._step_flops(TINY)


def test_bfloat16_row_counts_its_agreement_with_float32() -> None:
    row = bench_model.bench_beam(
        TINY, images=4, beam=3, max_length=5, rounds=1, dtype=torch.bfloat16
    )
    assert row["dtype"] == "bfloat16"
    assert 0 <= row["images_with_the_float32_caption"] <= 4
    assert 0 <= row["images_with_the_same_caption_both_ways"] <= 4
    assert row["same_captions"] == (row["images_with_the_same_caption_both_ways"] == 4)


def test_speedup_bound_is_one_at_a_time_over_products_at_the_peak() -> None:
    # 4 GFLOP of products at 1 GFLOP/s take 4 s at best; one at a time took 2 s
    beam = {"one_at_a_time_s": 2.0, "batched_matmul_flops": 4e9}
    assert bench_model.speedup_bound(beam, 1e9) == pytest.approx(0.5)


def test_the_tutorials_reference_computes_the_models_loss_and_gradients() -> None:
    """The reference decodes only the captions still running, sorted by length: the same loss
    (Eq. 14) and gradients as the readable model over the padded batch, in float64."""
    torch.manual_seed(0)
    config = model_config(
        vocab_size=12, annotation_dim=5, num_locations=4, embed_dim=6, hidden_dim=7, attention_dim=3
    )
    model = ShowAttendTell(config).double().train()
    gen = torch.Generator().manual_seed(1)
    annotations = torch.randn(6, 4, 5, generator=gen, dtype=torch.float64)
    captions = bench_model._captions(6, 8, 12, gen)
    assert len(set((captions != PAD_ID).sum(1).tolist())) > 1  # lengths differ
    criterion = build_criterion("soft", SoftTrainConfig(doubly_stochastic=0.7))
    params = list(model.parameters())
    want = criterion(model(annotations, captions), captions).loss
    got = bench_model.tutorial_loss(model, annotations, captions, 0.7)
    torch.testing.assert_close(got, want)
    for g, w in zip(
        torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True
    ):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
def test_a_tree_loaded_beside_is_timed_in_the_same_rounds() -> None:
    """``--baseline``: another checkout's modules (here this one's, loaded a second time) run
    the same training step and beam search beside this tree's."""
    tree = bench_model.load_tree(BENCHMARKS.parent)
    assert tree["decoder"].ShowAttendTell is not ShowAttendTell
    row = bench_model.bench_against_reference(TINY, batch=4, rounds=1, baseline=tree)
    assert row["over_baseline"] > 0 and row["speedup_over_reference"] > 0
    # the reference's products skip the finished captions: fewer than every padded step's
    assert 0 < row["necessary_matmul_flops"] < bench_model.train_step_flops(TINY, 4, 20)
    bench_model._add_training_bound(row, peak=0.0)  # the rounds' own product is the peak
    reference_s = 4 / row["reference_captions_per_s"]
    at_peak_s = row["necessary_matmul_flops"] / row["interleaved_matmul_peak_flops_per_s"]
    assert row["speedup_bound_at_float32_matmul_peak"] == pytest.approx(reference_s / at_peak_s)
    beam = bench_model.bench_beam(
        TINY, images=2, beam=2, max_length=4, rounds=1, baseline=tree, compiled=True
    )
    assert beam["batched_over_baseline"] > 0 and beam["same_captions"] is True
    # the step through torch.compile: its compile time, its rate beside both, its captions
    assert beam["decoding_compile_s"] > 0 and beam["compiled_same_captions"] is True
    assert beam["batched_compiled_over_baseline"] > 0 and beam["batched_compiled_over_batched"] > 0


@pytest.mark.slow
def test_each_kept_piece_is_timed_against_compiled_readable_code() -> None:
    """``--comparison``'s ``kept_over_compiled``: the training recurrence and decoding
    against ``torch.compile`` of the readable step, each with its compile time."""
    row = bench_model.bench_compiled(TINY, batch=4, rounds=1, beam_images=2)
    assert "error" not in row, row.get("error")
    for piece in ("training_recurrence", "decoding"):
        assert row[f"{piece}_compile_s"] > 0
        assert row[piece]["native_over_compiled"] > 0 and row[piece]["native_over_readable"] > 0
