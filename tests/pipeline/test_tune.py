"""Ray Tune sweep: the search space, the searchers, the winner's ``dvc exp run`` line, and what a
finished sweep records (ASHA over Ray Train trials, MLflow parent and child runs,
best_params.yaml), checked on the sweep tests/pipeline/test_dvc_pipeline.py runs as the README
gives it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from pipeline.ray.tune import _search_alg, _with_overrides, search_space
from pipeline.stages import tune as tune_stage
from pipeline.tracking.runs import PARENT_TAG, connect
from sat_model.config import Params, ParamsError, TuneConfig, apply_overrides, load_params


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


def test_the_search_bounds_contain_the_default_params() -> None:
    for attention in ("soft", "hard"):
        params = Params(tune=TuneConfig(attention=attention))
        section = getattr(params.train, attention)
        for key in search_space(params.tune):
            lo, hi = getattr(params.tune, key.rsplit(".", 1)[1])
            assert lo <= getattr(section, key.rsplit(".", 1)[1]) <= hi, key


def test_optuna_tpe_is_the_default_searcher_and_random_the_option() -> None:
    from optuna.samplers import TPESampler
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from ray.tune.search.optuna import OptunaSearch

    assert TuneConfig().search_alg == "optuna"
    searcher = _search_alg(TuneConfig())
    assert isinstance(searcher, OptunaSearch) and isinstance(searcher._sampler, TPESampler)
    assert isinstance(_search_alg(TuneConfig(search_alg="random")), BasicVariantGenerator)
    with pytest.raises(ValueError, match="lower bound"):
        TuneConfig(lr=(1e-2, 1e-4))


def test_an_unknown_search_alg_is_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("tune: {search_alg: hyperopt}\n")
    with pytest.raises(ParamsError, match=r"tune\.search_alg"):
        load_params(tmp_path / "params.yaml")


def test_apply_trains_the_winner_with_the_sweeps_own_overrides_and_the_best_values() -> None:
    best = {"train.soft.lr": 0.004123456789, "train.soft.doubly_stochastic": 1e-05}
    given = ["tune.num_samples=4", "model.hidden_dim=64", "train.soft.lr=0.1"]
    command = tune_stage.apply_command(best, given)
    assert command[:3] == ["dvc", "exp", "run"] and set(command[3::2]) == {"-S"}
    assert command[4::2] == [
        "model.hidden_dim=64",  # the trial trained with it: so does the winner
        "train.soft.doubly_stochastic=1e-05",
        "train.soft.lr=0.004123456789",  # the best value, not the one given to the sweep
    ]
    applied = apply_overrides(Params().model_dump(mode="json"), command[4::2])
    assert applied["train"]["soft"]["doubly_stochastic"] == 1e-05  # a float, not the string
    assert applied["train"]["soft"]["lr"] == 0.004123456789


def check_recorded_sweep(project: Path, out: str, trials: int) -> None:
    """What a finished sweep of ``trials`` soft-attention trials leaves in ``project``: the trial
    table in its output ``out``, best_params.yaml, one MLflow parent run and a child per trial,
    and a ``dvc exp run`` line that trains the winner. The sweep itself is run the way the README
    gives it, in tests/pipeline/test_dvc_pipeline.py."""
    best = yaml.safe_load((project / "reports" / "tune" / "best_params.yaml").read_text())
    assert best["metric"] == "val_bleu_4" and best["attention"] == "soft"
    assert set(best["params"]) == {"train.soft.lr", "train.soft.doubly_stochastic"}
    assert f"{best['score']:.4f}" in out
    _check_trial_table(out, trials)
    params = load_params(project / "params.yaml")
    trial_values = _check_parent_and_child_runs(params, project, best, trials)
    # applying the printed `dvc exp run -S ...` line gives that trial's values exactly
    printed = [line for line in out.splitlines() if "dvc exp run" in line]
    assert printed and printed[-1].endswith(best["apply"])
    command = shlex.split(best["apply"])
    assert command[:3] == ["dvc", "exp", "run"]
    flags, overrides = command[3::2], command[4::2]
    assert set(flags) == {"-S"} and len(flags) == len(overrides) == 2
    applied = load_params(project / "params.yaml", overrides)
    assert applied.train.soft.lr == trial_values["train.soft.lr"]
    assert applied.train.soft.doubly_stochastic == trial_values["train.soft.doubly_stochastic"]
    assert applied.train.hard == params.train.hard and applied.model == params.model


def _check_trial_table(out: str, trials: int) -> None:
    """The trial table: a header, then rows of trial, status, epoch, searched values, BLEU-4."""
    table = out.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("trial "))
    assert table[header].split() == [
        "trial",
        "status",
        "epoch",
        "lr",
        "doubly_stochastic",
        "val_bleu_4",
    ]
    rows = [line.split() for line in table[header + 1 :] if len(line.split()) == 6]
    assert sum(row[1] == "done" for row in rows) == trials  # every trial ended, none in error
    assert {row[1] for row in rows} <= {"running", "done"}
    assert all(row[2] in {"1", "2"} for row in rows if row[1] == "running")


def _check_parent_and_child_runs(
    params: Params, project: Path, best: dict, trials: int
) -> dict[str, float]:
    """One parent run, a finished child per trial with its values and curves, and the best
    score one the winner logged; returns the winner's values."""
    tracking = connect(params.mlflow, project)
    client = tracking.client()
    runs = client.search_runs([tracking.experiment_id], "tags.`sat.sweep` = '1'")
    assert len(runs) == 1
    parent = runs[0]
    children = client.search_runs(
        [tracking.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    )
    assert len(children) == trials
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
    # the best is the trial it names: that trial logged the score and the params recorded
    (winner,) = [c for c in children if c.data.tags["sat.trial_id"] == best["trial_id"]]
    history = client.get_metric_history(winner.info.run_id, "val_bleu_4")
    assert best["score"] in [m.value for m in history]
    trial_values = {k: float(v) for k, v in winner.data.params.items()}
    assert best["params"] == trial_values
    return trial_values
