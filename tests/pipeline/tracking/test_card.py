"""The model card from a profile's records: what the data allows, the profile's params file,
the split sizes, and the seeds' spread. The card of a real registered version, against the
reports of the same run, is walked on the quickstart project (test_dvc_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.settings import load_params
from pipeline.tracking.governance.card import gather_card_facts, render_card

PARAMS = "data: {source: karpathy, root: coco, karpathy: {json_file: dataset_coco.json}}\n"


def _profile(root: Path) -> Path:
    """A dataset profile's folder as its run leaves it: params, a model folder's config and
    training record, the prepare report, the evaluation's metrics and captions."""
    folder = root / "profiles" / "coco"
    for sub in ("models/soft", "reports/soft", "data/prepared"):
        (folder / sub).mkdir(parents=True)
    (folder / "params.yaml").write_text(PARAMS)
    config = {"data": {"source": "karpathy"}, "train": {"seed": 2}, "model": {"embed_dim": 512}}
    config["hardware"] = {"device": "cuda (NVIDIA H200)"}
    (folder / "models/soft/config.json").write_text(json.dumps(config))
    (folder / "models/soft/train_metrics.json").write_text(
        json.dumps({"epochs": 7, "world_size": 4})
    )
    sizes = {"images_train": 113287, "images_val": 5000, "images_test": 5000}
    (folder / "data/prepared/prepare_report.json").write_text(json.dumps(sizes))
    (folder / "reports/soft/metrics.json").write_text(json.dumps({"bleu_4": 0.25, "cider": 0.8}))
    (folder / "reports/soft/captions.json").write_text(
        json.dumps({"split": "test", "images": 5000})
    )
    return folder / "params.yaml"


def test_a_card_says_what_the_data_allows_and_the_spread_of_the_seeds(tmp_path: Path) -> None:
    params_file = _profile(tmp_path)
    bleu = {"0": 0.241, "1": 0.252, "2": 0.25}
    facts = gather_card_facts(
        identity=("sat-captioner-coco", "5", "soft"),
        params=load_params(params_file),
        root=params_file.parent,
        params_file=params_file,
        lineage={"sat.prepared_md5": "abc.dir"},
        training_seconds=5400.0,
        seeds={seed: {"bleu_4": v} for seed, v in bleu.items()},
    )
    card = render_card(facts)
    assert card.startswith("# sat-captioner-coco version 5: model card")
    assert "| source | coco |" in card  # the Karpathy file names the dataset
    assert "COCO's captions are CC BY 4.0" in card
    assert "| params file | `profiles/coco/params.yaml` |" in card
    assert "| images train | 113287 |" in card
    assert "| prepared data (dvc.lock md5) | `abc.dir` |" in card
    assert "on the test split (5000 images)" in card and ", seed 2." in card
    assert "| training time | 90.0 min |" in card
    assert "| hardware | 4 worker(s); each on cuda (NVIDIA H200) |" in card
    values = np.array(list(bleu.values()))
    spread = f"mean {values.mean():.4f}, sd {values.std(ddof=1):.4f}, 0.2410-0.2520"
    assert f"- bleu_4 over 3 seeds (0, 1, 2): {spread}" in card
    assert "| `model.embed_dim` | 512 |" in card
