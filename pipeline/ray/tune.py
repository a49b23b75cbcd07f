"""Ray Tune sweep over the loss weights and learning rate, each trial a Ray Train run.

The pattern of Ray Train V2 (Ray >= 2.43): a Tune *function trainable* per trial builds and fits a
``TorchTrainer``; Train's per-epoch reports reach Tune through ``TuneReportCallback``. ASHA stops
weak trials early on the validation score ``train.monitor`` names (``val_bleu_4`` by default,
in its registered direction, :func:`objective`; time attribute ``epoch``). Searched:
the learning rate (log-uniform) and λ (Eq. 14) for soft attention; λ_r, λ_e and the
semi-sampling probability (Sec. 4.1) for hard attention. Bounds come from the ``tune`` params.
The searcher is Optuna's TPE (``tune.search_alg: optuna``, model-based: the authors tuned with
Whetlab, a Bayesian optimiser) or Tune's random search (``random``); ASHA schedules either.

MLflow: one parent run per sweep, one child run per trial (``mlflow.parentRunId``) holding that
trial's sampled values as params and its per-epoch metrics. The best trial's values go to
``<tune.output_dir>/best_params.yaml`` as ``-S``-ready dotted keys, with the
``dvc exp run -S ...`` line that trains the winner (also printed).

While it runs the driver prints a compact trial table (:func:`pipeline.ray.progress.trial_table`):
one row per trial result and per trial end, with the searched values and the monitored score.
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from pipeline.ray.fit import ScalingSpec, deterministic_run_name, fit_on_ray
from pipeline.ray.progress import trial_table
from pipeline.ray.runtime import ray_session, remove_orphaned_placement_groups, resolve_storage_path
from pipeline.ray.storage import Storage, workers_share_files
from pipeline.ray.train import (
    TrainJob,
    sat_train_fn,
    stage_worker_inputs,
    warn_if_tracking_is_driver_only,
)
from pipeline.settings import Params, TuneConfig, validate_params
from pipeline.tracking.lineage import lineage_tags
from pipeline.tracking.runs import Run, connect
from sat_model.atomic import write_text_atomic
from sat_model.evaluation.metrics import metric_direction
from sat_model.paths import absolute

__all__ = [
    "TuneResult",
    "best_overrides",
    "exp_run_command",
    "objective",
    "run_tune",
    "search_space",
]


def objective(params: Params) -> tuple[str, str]:
    """What the sweep optimises: (the reported key, "max" or "min"), from ``train.monitor`` and
    its metric's registered direction."""
    return f"val_{params.train.monitor}", metric_direction(params.train.monitor)


_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneResult:
    """The sweep's winner and where it is written down."""

    best_params: dict[str, float]  # dotted keys, e.g. {"train.soft.lr": 0.0007}
    best_score: float  # the best trial's last monitored score (val_<train.monitor>)
    best_params_file: Path
    parent_run_id: str
    num_trials: int


def search_space(cfg: TuneConfig) -> dict[str, Any]:
    """Tune's param space, keyed by the dotted params key each value overrides."""
    from ray import tune

    section = f"train.{cfg.attention}"
    space: dict[str, Any] = {f"{section}.lr": tune.loguniform(*cfg.lr)}
    if cfg.attention == "soft":
        space[f"{section}.doubly_stochastic"] = tune.uniform(*cfg.doubly_stochastic)  # λ
    else:
        space[f"{section}.lambda_r"] = tune.loguniform(*cfg.lambda_r)
        space[f"{section}.lambda_e"] = tune.uniform(*cfg.lambda_e)
        space[f"{section}.semi_sampling_p"] = tune.uniform(*cfg.semi_sampling_p)
    return space


def _with_overrides(params: Params, values: dict[str, Any], max_epochs: int) -> Params:
    """``params`` with dotted-key values set (re-validated, so bounds still hold)."""
    raw = params.model_dump(mode="json")
    for key, value in {**values, f"train.{params.tune.attention}.max_epochs": max_epochs}.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate_params(raw)


@dataclass(frozen=True)
class _Sweep:
    """What every trial shares (internal; handed to Tune by ``tune.with_parameters``)."""

    name: str
    job: TrainJob  # the worker config; each trial sets its params and its MLflow run
    max_epochs: int
    parent: Run  # the sweep's run; each trial's run is its child
    storage: Storage
    scaling: ScalingSpec


def _trial(config: dict[str, Any], sweep: _Sweep) -> None:
    """One trial (a Tune function trainable): a child MLflow run around a Ray Train fit."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    values = dict(config)
    params: Params = _with_overrides(sweep.job.params, values, sweep.max_epochs)
    trial_id = tune.get_context().get_trial_id()
    run = sweep.parent.tracking.start_run(
        f"{sweep.name}-{trial_id}",
        tags={"sat.attention": params.tune.attention, "sat.trial_id": trial_id},
        parent=sweep.parent,
    )
    run.log_params({k: repr(v) for k, v in values.items()})
    fit_on_ray(
        sat_train_fn,
        config=replace(sweep.job, params=params, run=run),
        run_name=f"{sweep.name}-{trial_id}",
        storage_path=sweep.storage,
        scaling=sweep.scaling,
        max_failures=params.ray.max_failures,
        callbacks=[TuneReportCallback()],
    )
    # Only success is written here. An error, and a stop by Tune (ASHA, max_t), is written by the
    # driver from Tune's verdict (_close_stopped_children): a stopped trial's fit raises while its
    # Train controller is torn down, which can be the very moment the driver closes the runs, and
    # a FAILED written from here then overwrote the driver's FINISHED (seen once in CI)
    run.finish()


def _search_alg(cfg: TuneConfig) -> Any:
    """Tune's searcher for ``tune.search_alg``: Optuna's TPE, or random sampling; both seeded."""
    if cfg.search_alg == "random":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        return BasicVariantGenerator(random_state=cfg.seed)
    if cfg.search_alg == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial otherwise
        return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    raise ValueError(f"unknown tune.search_alg {cfg.search_alg!r}; expected optuna or random")


def best_overrides(values: dict[str, float]) -> list[str]:
    """``key=value`` items that ``dvc exp run -S``, ``sat train -S`` and params.yaml take.

    ``repr`` is the shortest text that reads back as the same float, so applying them gives the
    trial's values exactly.
    """
    return [f"{key}={value!r}" for key, value in sorted(values.items())]


def exp_run_command(values: dict[str, float]) -> list[str]:
    """``dvc exp run -S k=v ...``: the pipeline run that trains the sweep's winner."""
    command = ["dvc", "exp", "run"]
    for item in best_overrides(values):
        command += ["-S", item]
    return command


def _placement_group_reaper() -> Any:
    """A Tune callback freeing the worker CPUs of trials that ASHA stopped, else later trials
    wait for them forever (see :func:`pipeline.ray.runtime.remove_orphaned_placement_groups`)."""
    from ray.tune import Callback

    class PlacementGroupReaper(Callback):
        def __init__(self) -> None:
            self.last = 0.0

        def on_step_begin(self, iteration: int, trials: list[Any], **info: Any) -> None:
            if time.monotonic() - self.last >= 1.0:  # a GCS round trip: not on every step
                self.last = time.monotonic()
                freed = remove_orphaned_placement_groups()
                if freed:
                    _log.info("freed the placement groups of stopped trials: %s", freed)

    return PlacementGroupReaper()


def run_tune(params: Params, *, project_root: Path, address: str | None = None) -> TuneResult:
    """Run the sweep described by ``params.tune``; ``address`` connects to a Ray cluster.

    ``project_root`` anchors relative paths: data, features, ray storage, MLflow.
    """
    from ray import tune

    root = project_root.resolve()
    sweep = _start_sweep(params, root)
    with ray_session(params.ray, address=address):
        tuner = tune.Tuner(
            # the trial only drives Ray Train: its workers hold the CPUs. Tune refuses an empty
            # request, and any CPU share held by drivers would starve a worker of a full CPU.
            tune.with_resources(
                tune.with_parameters(_trial, sweep=sweep), {"cpu": 0, "memory": 1 << 20}
            ),
            param_space=search_space(params.tune),
            tune_config=_tune_config(params.tune, objective(params)),
            run_config=tune.RunConfig(
                name=sweep.name,
                storage_path=sweep.storage.path,
                storage_filesystem=None if sweep.storage.is_local else sweep.storage.filesystem,
                verbose=0,  # Tune's own status tables: the trial table below instead
                callbacks=[
                    _placement_group_reaper(),
                    trial_table(list(search_space(params.tune)), objective(params)[0]),
                ],
            ),
        )
        results = tuner.fit()
        # the last trials' controllers die after fit returns: free their groups too, or a
        # cluster that outlives this sweep (a shared one, --address) keeps them reserved
        remove_orphaned_placement_groups(wait_s=30.0)
    _close_stopped_children(results, sweep.parent)
    return _record_best(results, params, root, sweep.parent)


def _start_sweep(params: Params, root: Path) -> _Sweep:
    """Name the sweep after its inputs, open (or find) its parent MLflow run."""
    cfg = params.tune
    lineage = lineage_tags(
        root, prepared_dir=params.data.prepared_dir, features_dir=params.encoder.features_dir
    )
    name = deterministic_run_name(
        f"sweep-{cfg.attention}", params.model_dump(mode="json", exclude={"ray", "mlflow"}), lineage
    )
    tracking = connect(params.mlflow, root)
    parent = tracking.start_run(
        name, tags={"sat.attention": cfg.attention, "sat.sweep": "1", **lineage}
    )
    parent.log_params({f"tune.{k}": str(v) for k, v in cfg.model_dump().items()})
    storage = resolve_storage_path(params.ray, root)
    share = workers_share_files(params.ray.worker_inputs, storage)
    warn_if_tracking_is_driver_only(tracking.tracking_uri, not share)
    prepared = absolute(params.data.prepared_dir, root)
    features = absolute(params.encoder.features_dir, root)
    job = TrainJob(
        params,
        cfg.attention,
        prepared_dir=prepared,
        features_dir=features,
        staged_inputs=stage_worker_inputs(
            storage, share, prepared, features, mirrored=params.train.mirror > 0
        ),
    )
    return _Sweep(
        name=name,
        job=job,
        max_epochs=cfg.max_epochs,
        parent=parent,
        storage=storage,
        scaling=ScalingSpec.from_params(params.ray),
    )


def _tune_config(cfg: TuneConfig, goal: tuple[str, str]) -> Any:
    """Tune's metric (``goal``: key and mode), sample count and concurrency, with ASHA over the
    chosen searcher."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    scheduler = ASHAScheduler(
        time_attr="epoch", max_t=cfg.max_epochs, grace_period=cfg.grace_period, reduction_factor=2
    )
    return tune.TuneConfig(
        metric=goal[0],
        mode=goal[1],
        num_samples=cfg.num_samples,
        max_concurrent_trials=cfg.max_concurrent,
        scheduler=scheduler,
        search_alg=_search_alg(cfg),
    )


def _close_stopped_children(results: Any, parent: Run) -> None:
    """Set each child run's status from Tune's verdict on its trial.

    Tune stops a trial (ASHA, or ``max_t`` reached before ``fit`` returned) by ending its actor,
    so ``_trial`` never gets to end its run, and it leaves errors to this function as well.
    Stopping on a schedule is a normal end: a trial without an error in Tune's results is
    FINISHED, any other FAILED.
    """
    succeeded = {r.metrics.get("trial_id") for r in results if r.error is None and r.metrics}
    for child, tags in parent.children():
        child.finish() if tags.get("sat.trial_id") in succeeded else child.fail()


def _record_best(results: Any, params: Params, root: Path, parent: Run) -> TuneResult:
    cfg, (metric, mode) = params.tune, objective(params)
    best = results.get_best_result(metric=metric, mode=mode, scope="last")
    if best is None or best.metrics is None or metric not in best.metrics:
        parent.fail()
        raise RuntimeError(f"no trial of the sweep reported {metric}; see the Ray logs")
    values = {k: float(v) for k, v in best.config.items()}
    score = float(best.metrics[metric])
    path = absolute(cfg.output_dir, root) / "best_params.yaml"
    doc = {
        "attention": cfg.attention,
        "metric": metric,
        "score": score,
        "trial_id": best.metrics.get("trial_id"),
        "params": values,  # dotted keys: `-S` items, or paths into params.yaml
        "apply": shlex.join(exp_run_command(values)),
    }
    write_text_atomic(path, yaml.safe_dump(doc, sort_keys=True))
    parent.log_metric(f"best_{metric}", score)
    parent.log_params({f"best.{k}": repr(v) for k, v in values.items()})
    parent.finish()
    print(
        f"best {metric} = {score:.4f} with " + ", ".join(f"{k}={v:.4g}" for k, v in values.items())
    )
    print(f"train the winner with:  {doc['apply']}")
    return TuneResult(values, score, path, parent.run_id, len(results))
