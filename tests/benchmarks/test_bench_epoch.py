"""``benchmarks/bench_epoch.py`` times the epochs the train stage runs: the same captions, the
same batches and, for self-critical epochs, one batch per ``scst_batch_size`` training images."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.settings import load_params
from sat_model.data.vocab import build_vocab, save_vocab
from tests.factories import ROOT, write_captions

BENCHMARKS = ROOT / "benchmarks"
PARAMS = BENCHMARKS.parent / "params.yaml"


def _load_bench_epoch() -> object:
    spec = importlib.util.spec_from_file_location("bench_epoch", BENCHMARKS / "bench_epoch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_epoch"] = module
    spec.loader.exec_module(module)
    return module


bench_epoch = _load_bench_epoch()

# 6 training images x 2 captions: 8 captions of 3 words (+ <end>) and 4 of 5 words
TRAIN = [
    (f"img{i}", "train", k, "a red circle" if i < 4 else "a big blue square here")
    for i in range(6)
    for k in range(2)
]
VAL = [(f"val{i}", "val", 0, "a red circle") for i in range(3)]


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    folder = tmp_path / "prepared"
    write_captions(folder / "captions.parquet", TRAIN + VAL)
    vocab = build_vocab((r[3].split() for r in TRAIN), 1, 100, 20)
    save_vocab(vocab, folder / "vocab.json")
    return folder


@pytest.fixture
def params_file(tmp_path: Path) -> Path:
    raw = yaml.safe_load(PARAMS.read_text(encoding="utf-8"))
    raw["model"].update(embed_dim=8, hidden_dim=12, attention_dim=6)
    for attention in ("soft", "hard"):
        raw["train"][attention].update(batch_size=3, scst_epochs=1, scst_batch_size=4)
    path = tmp_path / "profile" / "params.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_an_epoch_covers_every_caption_in_the_stages_batches(
    prepared: Path, params_file: Path, attention: str
) -> None:
    params = load_params(params_file)
    row = bench_epoch.bench_epoch(params, prepared, (2, 2, 5), attention, torch.device("cpu"))
    assert row["train_captions"] == 12
    # two caption lengths, batches of 3 of one length: 8 captions -> 3 batches, 4 -> 2
    assert row["likelihood_batches"] == row["likelihood_batches_timed"] == 5
    # 6 images in batches of 4 -> 2 self-critical batches
    assert row["self_critical_batches"] == row["self_critical_batches_timed"] == 2
    assert row["validation_images"] == 3
    assert row["likelihood_epoch_s"] > 0 and row["self_critical_epoch_s"] > 0


def test_main_scales_the_timed_batches_to_the_epoch_and_writes_json(
    prepared: Path, params_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench_epoch, "RESULTS", tmp_path / "results")
    out = bench_epoch.main(
        [
            "--params", str(params_file),
            "--prepared", str(prepared),
            "--grid", "2x2x5",
            "--device", "cpu",
            "--attention", "soft",
            "--max-batches", "1",
        ]
    )  # fmt: skip
    (row,) = out["epochs"]
    assert row["likelihood_batches"] == 5 and row["likelihood_batches_timed"] == 1
    assert row["self_critical_batches"] == 2 and row["self_critical_batches_timed"] == 1
    written = json.loads((tmp_path / "results" / "epoch_profile_cpu.json").read_text())
    assert written == out


def test_without_prepared_captions_it_says_what_to_run(
    params_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="run the prepare stage"):
        bench_epoch.main(["--params", str(params_file), "--prepared", str(tmp_path / "none")])
