"""Ray Train (V2 API of the pinned Ray) around the plain, single-process training function.

The driver builds a ``TorchTrainer`` whose every worker runs a *train function*
``train_fn(run: WorkerRun) -> None``. :class:`WorkerRun` is all the function sees of Ray: its
rank and world size, the device Ray placed it on, the local copy of the checkpoint to resume from,
a ``wrap_model`` hook (DDP via ``ray.train.torch.prepare_model``: gloo on CPU, NCCL on GPU) and
``report`` (every rank calls it once per epoch; rank 0 attaches the checkpoint directory). Running
a run again with the same name and storage path resumes from its last reported checkpoint (Ray
Train V2 restores the run's checkpoint state from storage), as do Ray's own restarts after a
worker failure.

:func:`train_with_ray` is the ``train`` stage's use of it: ``sat_model.train_run.train_model`` on
every worker, rank 0 logging each epoch to MLflow once, the final checkpoint copied from Ray's
storage into ``models/<attention>/`` on the driver. Its runs are named after the run's identity
(``pipeline.run_identity``: declared params, DVC hashes of code and data, versions) and an attempt
number, ``sat-<attention>-<12 hex>-<n>``. An invocation trains from epoch 1 in a new attempt
unless a run of that identity finished (then it trains nothing and hands back that run's model)
or ``resume=True`` names an unfinished one (then it continues from its last epoch); it says
which in one line on stderr. Each epoch's checkpoint carries the best model and the last
training state (``last_state.pt``), so a restart continues from the last finished epoch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sat_model.atomic import remove_dead_temps, replace_dir, temp_dir, write_text_atomic
from sat_model.checkpoint import is_checkpoint_dir
from sat_model.config import RayConfig
from sat_model.paths import output_path
from sat_model.training import Callback, EpochState

from .ray_runtime import loopback_env, resolve_use_gpu
from .run_identity import RunIdentity

__all__ = [
    "RUN_RECORD",
    "FitOutcome",
    "ScalingSpec",
    "TrainFn",
    "TrainOutcome",
    "WorkerRun",
    "copy_checkpoint",
    "deterministic_run_name",
    "fit_on_ray",
    "sat_train_fn",
    "train_with_ray",
]


@dataclass(frozen=True)
class WorkerRun:
    """One Ray Train worker's view of the run, handed to the train function."""

    rank: int
    world_size: int
    device: torch.device
    resume_dir: Path | None  # local copy of the latest reported checkpoint, None on a fresh run
    config: Mapping[str, Any]  # train_loop_config: plain values and absolute paths

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move to this worker's device; wrap in DDP when there is more than one worker."""
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def report(self, metrics: Mapping[str, float], checkpoint_dir: Path | None = None) -> None:
        """Report this epoch; every rank must call it (a barrier), rank 0 with the checkpoint.

        The directory is copied to Ray's storage before this returns, so the caller may delete it.
        """
        import ray.train

        checkpoint = None
        if self.rank == 0 and checkpoint_dir is not None:
            checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir))
        ray.train.report(dict(metrics), checkpoint=checkpoint)


TrainFn = Callable[[WorkerRun], None]


def _worker_entry(train_fn: TrainFn, config: dict[str, Any]) -> None:
    """What Ray runs on each worker: build the :class:`WorkerRun`, call the train function."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    # intra-op threads = the CPUs Ray reserved for this worker, so workers do not oversubscribe
    torch.set_num_threads(int(config["torch_threads"]))
    checkpoint = ray.train.get_checkpoint()
    with tempfile.TemporaryDirectory(prefix="sat-resume-") as tmp:
        resume_dir = None
        if checkpoint is not None:
            resume_dir = Path(tmp) / "checkpoint"
            checkpoint.to_directory(str(resume_dir))
        run = WorkerRun(
            rank=context.get_world_rank(),
            world_size=context.get_world_size(),
            device=ray.train.torch.get_device(),
            resume_dir=resume_dir,
            config=config,
        )
        train_fn(run)


@dataclass(frozen=True)
class ScalingSpec:
    """How many workers and what each holds (``ray.num_workers``, ``ray.cpus_per_worker``)."""

    num_workers: int
    cpus_per_worker: int
    use_gpu: bool

    @classmethod
    def from_params(cls, cfg: RayConfig) -> ScalingSpec:
        return cls(cfg.num_workers, cfg.cpus_per_worker, resolve_use_gpu(cfg.use_gpu))

    def to_ray(self) -> Any:
        from ray.train import ScalingConfig

        return ScalingConfig(
            num_workers=self.num_workers,
            use_gpu=self.use_gpu,
            resources_per_worker={"CPU": self.cpus_per_worker, "GPU": int(self.use_gpu)},
        )


@dataclass(frozen=True)
class FitOutcome:
    """What a finished Ray Train run left behind."""

    run_name: str
    storage_dir: Path  # <storage_path>/<run_name>
    checkpoint_dir: Path | None  # the last reported checkpoint in storage
    metrics: dict[str, Any]  # the last report's metrics (rank 0)


def deterministic_run_name(prefix: str, *parts: Any) -> str:
    """``<prefix>-<12 hex>`` from the JSON of ``parts``: same inputs, same run, so it resumes."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{prefix}-{hashlib.sha256(blob).hexdigest()[:12]}"


def fit_on_ray(
    train_fn: TrainFn,
    *,
    config: Mapping[str, Any],
    run_name: str,
    storage_path: Path,
    scaling: ScalingSpec,
    max_failures: int,
    callbacks: Sequence[Any] = (),
) -> FitOutcome:
    """Run ``train_fn`` on every worker under a ``TorchTrainer``; Ray must be initialised.

    ``max_failures`` restarts (``FailureConfig``) resume from the last reported checkpoint.
    ``callbacks`` are Ray Train ``UserCallback`` s (Tune passes its ``TuneReportCallback``).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    if not storage_path.is_absolute():
        raise ValueError(f"storage_path must be absolute (Ray workers change cwd): {storage_path}")
    trainer = TorchTrainer(
        functools.partial(_worker_entry, train_fn),
        train_loop_config={"torch_threads": scaling.cpus_per_worker, **config},
        scaling_config=scaling.to_ray(),
        run_config=RunConfig(  # type: ignore[call-arg]  # worker_runtime_env: not in its stubs
            name=run_name,
            storage_path=str(storage_path),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),  # the last and the one before
            callbacks=list(callbacks) or None,
            worker_runtime_env={"env_vars": _worker_env()},
        ),
    )
    result = trainer.fit()
    checkpoint = Path(result.checkpoint.path) if result.checkpoint is not None else None
    return FitOutcome(run_name, storage_path / run_name, checkpoint, dict(result.metrics or {}))


def _worker_env() -> dict[str, str]:
    keys = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED", "MLFLOW_TRACKING_URI")
    env = loopback_env()
    return {k: env[k] for k in keys if k in env}


def copy_checkpoint(source: Path, destination: Path) -> None:
    """Replace ``destination`` by a durable copy of ``source`` in one rename.

    Only a folder sat wrote (a checkpoint: ``model.pt`` beside a sat ``config.json``) or an empty
    one is replaced: ``models_dir`` pointing at a folder of the user's raises
    :class:`~sat_model.atomic.ForeignFolderError` and deletes nothing. Temporary copies left by
    killed writers (``.<attention>.<pid>.*``) are removed first.
    """
    remove_dead_temps(destination.parent, destination.name)
    staging = temp_dir(destination.parent, destination.name)
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
        replace_dir(staging, destination, owned=is_checkpoint_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------ the sat train stage on Ray
@dataclass(frozen=True)
class TrainOutcome:
    """A trained model folder and where its run is recorded."""

    model_dir: Path  # models/<attention>/ on the driver
    run_name: str  # Ray Train run and MLflow run name
    mlflow_run_id: str | None
    metrics: dict[str, Any]  # train_metrics.json


class _RayEpochReporter(Callback):
    """``sat_model.training`` callback: each epoch to Ray (checkpoint from rank 0) and MLflow."""

    def __init__(self, run: WorkerRun, model_dir: Path, logger: Any | None) -> None:
        self.run, self.model_dir, self.logger = run, model_dir, logger

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        hook = self.run.config.get("on_epoch_start")
        if hook is not None:  # tests inject worker faults here
            hook(self.run, epoch)

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        hook = self.run.config.get("on_step")
        if hook is not None:  # tests kill a worker mid-epoch here (with a small log_every)
            hook(self.run, epoch, step)

    def on_epoch_end(self, state: EpochState) -> None:
        metrics = {"train_loss": state.train_loss, "lr": state.lr}
        metrics.update({f"val_{k}": v for k, v in (state.val_metrics or {}).items()})
        if self.logger is not None:
            self.logger.log_epoch(state.epoch, metrics)  # step=epoch, once across restarts
        # train_model has rewritten model_dir (best checkpoint, metrics, curves) before this runs
        self.run.report({"epoch": state.epoch, **metrics}, self.model_dir)


def sat_train_fn(run: WorkerRun) -> None:
    """Every worker: ``train_model`` on this rank's shard; rank 0 reports the model folder."""
    from sat_model.train_run import train_model

    from .tracking import EpochLogger, Tracking, flatten, log_params

    cfg = run.config
    params, attention = cfg["params"], cfg["attention"]
    resume = run.resume_dir or (Path(cfg["resume_from"]) if cfg.get("resume_from") else None)
    logger = None
    if run.rank == 0 and cfg.get("tracking"):
        tracking = Tracking(**cfg["tracking"])
        log_params(tracking, cfg["mlflow_run_id"], flatten(cfg["logged_params"]))
        logger = EpochLogger(tracking, cfg["mlflow_run_id"])
    with tempfile.TemporaryDirectory(prefix="sat-train-") as out:
        model_dir = Path(out) / attention
        if run.rank == 0 and resume is not None:
            # a resumed run may not beat the best epoch again: keep its files in what we report
            shutil.copytree(resume, model_dir)
        train_model(
            params,
            attention,
            prepared_dir=cfg["prepared_dir"],
            features_dir=cfg["features_dir"],
            out_dir=out,
            rank=run.rank,
            world_size=run.world_size,
            device=run.device,
            callbacks=[_RayEpochReporter(run, model_dir, logger)],
            resume_from=resume,
            wrap_model=run.wrap_model,
            identity=cfg.get("identity"),
            log_every=int(cfg.get("log_every", 50)),
        )


def _abs(path: str, root: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (root / p).resolve()


RUN_RECORD = "sat_run.json"  # in a run's storage folder: its identity, status, checkpoint


@dataclass(frozen=True)
class _Attempt:
    """One earlier run of an identity in Ray's storage, with what the driver recorded of it."""

    number: int
    folder: Path  # <storage>/<name>
    record: dict[str, Any]  # RUN_RECORD's content, {} when unreadable

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def checkpoint(self) -> Path | None:
        """The final checkpoint of a finished run that is still in storage, else None."""
        relative = self.record.get("checkpoint")
        if self.record.get("status") != "FINISHED" or not relative:
            return None
        path = self.folder / relative
        return path if path.is_dir() else None


def _attempts(storage: Path, base: str) -> list[_Attempt]:
    """The runs called ``<base>-<n>`` under ``storage``, by attempt number."""
    found = []
    for folder in storage.glob(f"{base}-*"):
        suffix = folder.name.removeprefix(f"{base}-")
        if folder.is_dir() and suffix.isdigit():
            found.append(_Attempt(int(suffix), folder, _read_record(folder / RUN_RECORD)))
    return sorted(found, key=lambda a: a.number)


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(storage: Path, name: str, record: Mapping[str, Any]) -> None:
    write_text_atomic(storage / name / RUN_RECORD, json.dumps(record, indent=1) + "\n")


def _choose_run(
    attempts: Sequence[_Attempt], base: str, attention: str, resume: bool
) -> tuple[str, _Attempt | None]:
    """(run name, finished attempt to reuse or None); prints the one line saying which."""
    stage = f"train@{attention}"
    done = next((a for a in reversed(attempts) if a.checkpoint is not None), None)
    if done is not None:
        _say(f"{stage}: nothing to train: run {done.name} of this identity finished")
        return done.name, done
    if resume and attempts:
        last = attempts[-1]
        _say(f"{stage}: resuming run {last.name} from its last epoch checkpoint")
        return last.name, None
    name = f"{base}-{attempts[-1].number + 1 if attempts else 1}"
    if not attempts:
        why = "no earlier run of this identity" + (" to resume" if resume else "")
    else:
        why = f"run {attempts[-1].name} of this identity did not finish; --resume continues it"
    _say(f"{stage}: training from epoch 1 as run {name} ({why})")
    return name, None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train_with_ray(
    params: Any,
    attention: str,
    *,
    project_root: Path,
    address: str | None = None,
    resume_from: Path | None = None,
    resume: bool = False,
    extra_config: Mapping[str, Any] | None = None,
) -> TrainOutcome:
    """The ``train`` stage: Ray Train over ``train_model``, MLflow run, ``models/<attention>/``.

    ``project_root`` anchors every relative path in params (workers get absolute ones).
    ``resume`` continues the latest unfinished run of this identity; ``resume_from`` seeds a new
    run from a checkpoint folder (its content is part of the identity); ``extra_config`` reaches
    the workers' ``train_loop_config`` (tests use it to inject faults).
    """
    from .ray_runtime import resolve_storage_path
    from .run_identity import train_identity
    from .tracking import connect, tag_trained_checkpoint

    root = project_root.resolve()
    prepared = _abs(params.data.prepared_dir, root)
    features = _abs(params.encoder.features_dir, root)
    seed = [resume_from.resolve()] if resume_from else []
    inputs = [prepared / "captions.parquet", prepared / "vocab.json", features, *seed]
    identity = train_identity(params, attention, root, inputs=inputs)
    storage = resolve_storage_path(params.ray, root)
    base = f"sat-{attention}-{identity.short}"
    name, done = _choose_run(_attempts(storage, base), base, attention, resume)
    model_dir = output_path(params.train.models_dir, root) / attention
    if done is not None:
        checkpoint, run_id = done.checkpoint, done.record.get("mlflow_run_id")
    else:
        config = {
            "params": params,
            "attention": attention,
            "prepared_dir": str(prepared),
            "features_dir": str(features),
            "resume_from": str(seed[0]) if seed else None,
            "identity": identity.digest,
            **(extra_config or {}),
        }
        checkpoint, run_id = _fit_run(params, attention, root, name, identity, config, address)
    assert checkpoint is not None  # _choose_run returns an attempt that has a checkpoint
    copy_checkpoint(checkpoint, model_dir)
    if run_id:  # how `register` finds the training run of the model it registers
        tag_trained_checkpoint(connect(params.mlflow, root), run_id, model_dir)
    metrics_file = model_dir / "train_metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    return TrainOutcome(model_dir, name, run_id, metrics)


def _fit_run(
    params: Any,
    attention: str,
    root: Path,
    name: str,
    identity: RunIdentity,
    config: dict[str, Any],
    address: str | None,
) -> tuple[Path, str]:
    """Run (or resume) the Ray Train run ``name`` under its MLflow run; (checkpoint, run id)."""
    from .ray_runtime import ray_session, resolve_storage_path
    from .tracking import connect, find_or_create_run, lineage_tags

    lineage = lineage_tags(
        root, prepared_dir=params.data.prepared_dir, features_dir=params.encoder.features_dir
    )
    tracking = connect(params.mlflow, root)
    tags = {"sat.attention": attention, "sat.identity": identity.digest, **lineage}
    run_id = find_or_create_run(tracking, name, tags=tags)
    storage = resolve_storage_path(params.ray, root)
    record = {"identity": identity.digest, "inputs": identity.inputs, "mlflow_run_id": run_id}
    _write_record(storage, name, {**record, "status": "RUNNING"})
    config.update(
        tracking=tracking.__dict__,
        mlflow_run_id=run_id,
        logged_params={"attention": attention, **identity.inputs["params"]},
    )
    try:
        with ray_session(params.ray, address=address):
            outcome = fit_on_ray(
                sat_train_fn,
                config=config,
                run_name=name,
                storage_path=storage,
                scaling=ScalingSpec.from_params(params.ray),
                max_failures=params.ray.max_failures,
            )
    except BaseException:
        tracking.call(lambda c: c.set_terminated(run_id, "FAILED"), f"end run {run_id}")
        raise
    if outcome.checkpoint_dir is None:
        raise RuntimeError(f"Ray Train run {name} finished without a checkpoint")
    checkpoint = os.path.relpath(outcome.checkpoint_dir, outcome.storage_dir)  # project may move
    finished = {**record, "status": "FINISHED", "checkpoint": checkpoint}
    _write_record(storage, name, finished)
    tracking.call(lambda c: c.set_terminated(run_id, "FINISHED"), f"end run {run_id}")
    return outcome.checkpoint_dir, run_id
