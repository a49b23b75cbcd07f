"""``benchmarks/bench_model.py``'s beam search rows: batched against one image at a time in
float32 and in bfloat16, and the bound the matrix products put on their ratio."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_load("reference_model")  # bench_model imports it as a top-level module
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
