"""Ray Tune sweep: the search space, the searchers, the winner's ``dvc exp run`` line, and what a
finished sweep records (ASHA over Ray Train trials, MLflow parent and child runs,
best_params.yaml), checked on the sweep tests/pipeline/test_dvc_pipeline.py runs as the README
gives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.ray.tune import _search_alg, _with_overrides, search_space
from pipeline.settings import Params, TuneConfig, load_params
from pipeline.stages import tune as tune_stage
from sat_model.config import ParamsError
from sat_model.params import apply_overrides


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
