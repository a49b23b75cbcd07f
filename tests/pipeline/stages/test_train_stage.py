"""``python -m pipeline.stages.train``: params file in, models/<attention>/ out."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.stages import train
from sat_model.data.vocab import build_vocab, save_vocab
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureWriter
from tests.factories import write_captions

L, D = 4, 6
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")


def _write_inputs(root: Path) -> Path:
    """A tiny prepared dir and feature store per ARCHITECTURE.md, and a params file using them."""
    rows, feats = [], {"train": ([], []), "val": ([], [])}
    rng = np.random.default_rng(1)
    for split, n in (("train", 12), ("val", 3)):
        for i in range(n):
            image_id, colour = f"{split}{i}", ["red", "blue", "green"][i % 3]
            vec = (rng.standard_normal((L, D)) * 0.1).astype(np.float16)
            vec[:, i % 3] += 2.0
            feats[split][0].append(image_id)
            feats[split][1].append(vec)
            rows.append((image_id, split, 0, f"a {colour} circle", ["a", colour, "circle"]))
    prepared = root / "data" / "prepared"
    prepared.mkdir(parents=True)
    write_captions(prepared / "captions.parquet", [r[:4] for r in rows])
    save_vocab(build_vocab([r[4] for r in rows], 1, 50, 20), prepared / "vocab.json")
    spec = EncoderSpec("random", "none", 32, L, D, 2, 2, "0" * 64)
    for split, (ids, vecs) in feats.items():
        with FeatureWriter(root / "data" / "features" / f"{split}.arrow", spec) as writer:
            writer.write(ids, np.stack(vecs))
    params = root / "params.yaml"
    params.write_text(
        f"data:\n  prepared_dir: {prepared}\n"
        f"encoder:\n  features_dir: {root / 'data' / 'features'}\n"
        "model:\n  embed_dim: 8\n  hidden_dim: 16\n  attention_dim: 8\n"
        f"train:\n  val_images: 3\n  val_max_length: 5\n  models_dir: {root / 'models'}\n"
        "  soft:\n    batch_size: 4\n    max_epochs: 1\n"
    )
    return params


@pytest.mark.slow
@pytest.mark.java
@needs_java
def test_train_stage_writes_model_folder_and_resumes_from_it(tmp_path: Path) -> None:
    params = _write_inputs(tmp_path)
    args = ["--params", str(params), "--attention", "soft", "--no-progress", "--in-process"]
    assert train.main(args) == 0
    model_dir = tmp_path / "models" / "soft"
    for name in (
        "model.safetensors",
        "config.json",
        "vocab.json",
        "train_metrics.json",
        "curves.csv",
    ):
        assert (model_dir / name).is_file(), name
    assert json.loads((model_dir / "train_metrics.json").read_text())["epochs"] == 1
    # continue the same run for one more epoch, with -S raising the epoch budget
    resumed = tmp_path / "resume"
    shutil.copytree(model_dir, resumed)
    code = train.main(
        [
            "--params",
            str(params),
            "--attention",
            "soft",
            "--no-progress",
            "--in-process",
            "-S",
            "train.soft.max_epochs=2",
            "--resume-from",
            str(resumed),
        ]
    )
    assert code == 0
    with (model_dir / "curves.csv").open() as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2]
    assert json.loads((model_dir / "train_metrics.json").read_text())["epochs"] == 2


def test_train_stage_rejects_a_bad_override_by_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = _write_inputs(tmp_path)
    with pytest.raises(SystemExit) as exited:  # one line on stderr, no traceback
        train.main(["--params", str(params), "--attention", "soft", "-S", "train.soft.lr=fast"])
    assert exited.value.code == 1
    assert "train: error: invalid params:" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()
