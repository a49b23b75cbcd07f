"""Ray Tune sweep: ASHA over Ray Train trials, MLflow parent and child runs, best_params.yaml."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.stages import tune as tune_stage
from pipeline.tracking import PARENT_TAG, connect
from pipeline.tune import _with_overrides, search_space
from sat_model.config import Params, TuneConfig, load_params


def test_search_space_covers_lambda_for_soft_and_the_reinforce_weights_for_hard() -> None:
    soft = search_space(TuneConfig(attention="soft"))
    hard = search_space(TuneConfig(attention="hard"))
    assert set(soft) == {"train.soft.lr", "train.soft.doubly_stochastic"}
    assert set(hard) == {
        "train.hard.lr",
        "train.hard.lambda_r",
        "train.hard.lambda_e",
        "train.hard.semi_sampling_p",
    }
    lo, hi = TuneConfig().lr
    samples = [soft["train.soft.lr"].sample() for _ in range(200)]
    assert all(lo <= s <= hi for s in samples)


def test_a_hard_trial_overrides_its_sampled_values_and_the_sweep_epochs_only() -> None:
    params = Params(tune=TuneConfig(attention="hard", max_epochs=3))
    sampled = {k: v.sample() for k, v in search_space(params.tune).items()}
    trial = _with_overrides(params, sampled, params.tune.max_epochs)
    assert trial.train.hard.lr == sampled["train.hard.lr"]
    assert trial.train.hard.lambda_r == sampled["train.hard.lambda_r"]
    assert trial.train.hard.lambda_e == sampled["train.hard.lambda_e"]
    assert trial.train.hard.semi_sampling_p == sampled["train.hard.semi_sampling_p"]
    assert trial.train.hard.max_epochs == 3
    assert trial.train.soft == params.train.soft and trial.model == params.model
    with pytest.raises(ValueError, match="semi_sampling_p"):  # re-validated: bounds still hold
        _with_overrides(params, {"train.hard.semi_sampling_p": 1.5}, 3)


@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.java
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_tiny_sweep_records_parent_and_child_runs_and_best_params(
    ray_local: object, tiny_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tune_stage.main(["--params", str(tiny_project / "params.yaml")]) == 0
    best_file = tiny_project / "reports" / "tune" / "best_params.yaml"
    best = yaml.safe_load(best_file.read_text())
    assert best["metric"] == "val_bleu_4" and best["attention"] == "soft"
    assert set(best["params"]) == {"train.soft.lr", "train.soft.doubly_stochastic"}
    assert f"{best['score']:.4f}" in capsys.readouterr().out

    params = load_params(tiny_project / "params.yaml")
    tracking = connect(params.mlflow, tiny_project)
    client = tracking.client()
    runs = client.search_runs([tracking.experiment_id], "tags.`sat.sweep` = '1'")
    assert len(runs) == 1
    parent = runs[0]
    children = client.search_runs(
        [tracking.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    )
    assert len(children) == 3
    scores = []
    for child in children:
        assert child.info.status == "FINISHED"  # also those Tune stopped (ASHA, max_t)
        assert set(child.data.params) == {"train.soft.lr", "train.soft.doubly_stochastic"}
        lam = float(child.data.params["train.soft.doubly_stochastic"])
        assert 0.0 <= lam <= 2.0
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_bleu_4")]
        assert steps and steps == sorted(set(steps)) and set(steps) <= {1, 2}  # ASHA may stop at 1
        assert client.get_metric_history(child.info.run_id, "val_cider")
        scores += [m.value for m in client.get_metric_history(child.info.run_id, "val_bleu_4")]
    # the best is a score some trial really logged; not necessarily the max of the children's
    # last MLflow values: a trial that ASHA stops can log one more epoch than Tune received
    assert any(best["score"] == pytest.approx(s, rel=1e-9, abs=0.0) for s in scores)
    assert parent.data.metrics["best_val_bleu_4"] == pytest.approx(best["score"])
