"""Ray Train (V2 API of the pinned Ray) around the plain, single-process training function.

Every worker of the driver's ``TorchTrainer`` runs ``train_fn(run: WorkerRun)``; :class:`WorkerRun`
is all the function sees of Ray: rank, world size, device, the checkpoint to resume from, a
``wrap_model`` hook (DDP: gloo on CPU, NCCL on GPU) and ``report`` (once per epoch; rank 0
attaches the checkpoint folder). A run started again with the same name and storage resumes from
its last reported checkpoint, as do Ray's own restarts after a worker failure.

:func:`train_with_ray` is the ``train`` stage's use of it: ``train_model`` on every worker, rank
0 logging each epoch to MLflow, the final checkpoint copied into ``models/<attention>/``. Runs are
named after the run's identity (``pipeline.tracking.run_identity``) and an attempt number; an
invocation trains from epoch 1 unless a run of that identity finished (it hands back that
model) or ``resume=True`` names an unfinished one (it continues from its last epoch).
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
import torch

from pipeline.ray.runtime import loopback_env, resolve_use_gpu
from pipeline.ray.storage import AWS_ENV, Storage, fetch_inputs, upload_inputs, workers_share_files
from pipeline.tracking.run_identity import RunIdentity
from sat_model.atomic import remove_dead_temps, replace_dir, temp_dir
from sat_model.config import Params, RayConfig
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE
from sat_model.features.store import store_file
from sat_model.model.checkpoint import TRAIN_METRICS_FILE, is_checkpoint_dir
from sat_model.paths import absolute, output_path
from sat_model.train.trainer import Callback, EpochState

if TYPE_CHECKING:
    from pipeline.tracking.runs import Run

__all__ = [
    "RUN_RECORD",
    "RayFitResult",
    "RayTrainResult",
    "ScalingSpec",
    "StagedInputs",
    "TrainFn",
    "TrainJob",
    "WorkerHooks",
    "WorkerRun",
    "copy_checkpoint",
    "deterministic_run_name",
    "fit_on_ray",
    "sat_train_fn",
    "stage_worker_inputs",
    "train_with_ray",
    "warn_if_tracking_is_driver_only",
]


@dataclass(frozen=True)
class WorkerRun:
    """One Ray Train worker's view of the run, handed to the train function."""

    rank: int
    world_size: int
    device: torch.device
    resume_dir: Path | None  # local copy of the latest reported checkpoint, None on a fresh run
    config: Any  # what fit_on_ray was given (a TrainJob for sat_train_fn); absolute paths

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


def _worker_entry(train_fn: TrainFn, loop_config: dict[str, Any]) -> None:
    """What Ray runs on each worker: build the :class:`WorkerRun`, call the train function."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    # intra-op threads = the CPUs Ray reserved for this worker, so workers do not oversubscribe
    torch.set_num_threads(int(loop_config["torch_threads"]))
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
            config=loop_config["config"],
        )
        train_fn(run)


@dataclass(frozen=True)
class ScalingSpec:
    """How many workers, what each holds and where they go (``ray.num_workers``, ...)."""

    num_workers: int
    cpus_per_worker: int
    use_gpu: bool
    placement_strategy: str = "PACK"  # STRICT_SPREAD: one worker per node

    @classmethod
    def from_params(cls, cfg: RayConfig) -> ScalingSpec:
        use_gpu = resolve_use_gpu(cfg.use_gpu)
        return cls(cfg.num_workers, cfg.cpus_per_worker, use_gpu, cfg.placement_strategy)

    def to_ray(self) -> Any:
        from ray.train import ScalingConfig

        return ScalingConfig(
            num_workers=self.num_workers,
            use_gpu=self.use_gpu,
            resources_per_worker={"CPU": self.cpus_per_worker, "GPU": int(self.use_gpu)},
            placement_strategy=self.placement_strategy,
        )


@dataclass(frozen=True)
class RayFitResult:
    """What a finished Ray Train run left behind."""

    run_name: str
    storage_dir: Storage  # <storage_path>/<run_name>
    checkpoint: Storage | None  # the last reported checkpoint in storage
    metrics: dict[str, Any]  # the last report's metrics (rank 0)

    @property
    def checkpoint_dir(self) -> Path | None:
        """The last checkpoint's folder when the storage is local (None in an object store)."""
        if self.checkpoint is None or not self.checkpoint.is_local:
            return None
        return Path(self.checkpoint.path)


def deterministic_run_name(prefix: str, *parts: Any) -> str:
    """``<prefix>-<12 hex>`` from the JSON of ``parts``: same inputs, same run, so it resumes."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{prefix}-{hashlib.sha256(blob).hexdigest()[:12]}"


def fit_on_ray(
    train_fn: TrainFn,
    *,
    config: Any,
    run_name: str,
    storage_path: Path | Storage,
    scaling: ScalingSpec,
    max_failures: int,
    callbacks: Sequence[Any] = (),
) -> RayFitResult:
    """Run ``train_fn`` on every worker under a ``TorchTrainer``; Ray must be initialised.

    ``config`` reaches every worker as ``WorkerRun.config`` (picklable: a :class:`TrainJob` for
    :func:`sat_train_fn`, anything the given ``train_fn`` reads otherwise).

    ``max_failures`` restarts (``FailureConfig``) resume from the last reported checkpoint.
    ``callbacks`` are Ray Train ``UserCallback`` s (Tune passes its ``TuneReportCallback``).
    ``storage_path``: a local folder (absolute: Ray workers change cwd) or a :class:`Storage`.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    if isinstance(storage_path, Path):
        if not storage_path.is_absolute():
            raise ValueError(f"storage_path must be absolute (workers change cwd): {storage_path}")
        storage_path = Storage(pafs.LocalFileSystem(), str(storage_path), str(storage_path))
    storage = storage_path
    trainer = TorchTrainer(
        functools.partial(_worker_entry, train_fn),
        train_loop_config={"torch_threads": scaling.cpus_per_worker, "config": config},
        scaling_config=scaling.to_ray(),
        run_config=RunConfig(  # type: ignore[call-arg]  # worker_runtime_env: not in its stubs
            name=run_name,
            storage_path=storage.path,
            # Ray resolves a plain path itself; a URI's file system carries its endpoint
            storage_filesystem=None if storage.is_local else storage.filesystem,
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),  # the last and the one before
            callbacks=list(callbacks) or None,
            worker_runtime_env={"env_vars": _worker_env()},
        ),
    )
    result = trainer.fit()
    checkpoint = None
    if result.checkpoint is not None:
        path = result.checkpoint.path
        checkpoint = Storage(storage.filesystem, path, storage.uri + path[len(storage.path) :])
    return RayFitResult(run_name, storage.child(run_name), checkpoint, dict(result.metrics or {}))


def _worker_env() -> dict[str, str]:
    keys = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED", "MLFLOW_TRACKING_URI")
    env = loopback_env()
    return {k: env[k] for k in (*keys, *AWS_ENV) if k in env}


def copy_checkpoint(source: Path | Storage, destination: Path) -> None:
    """Replace ``destination`` by a durable copy of ``source`` (local or in storage) in one rename.

    Only a folder sat wrote (a checkpoint: weights beside a sat ``config.json``) or an empty
    one is replaced: ``models_dir`` pointing at a folder of the user's raises
    :class:`~sat_model.atomic.ForeignFolderError` and deletes nothing. Temporary copies left by
    killed writers (``.<attention>.<pid>.*``) are removed first.
    """
    remove_dead_temps(destination.parent, destination.name)
    staging = temp_dir(destination.parent, destination.name)
    try:
        if isinstance(source, Path):
            source = Storage(pafs.LocalFileSystem(), str(source), str(source))
        source.download(staging)
        replace_dir(staging, destination, owned=is_checkpoint_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------ the sat train stage on Ray
@dataclass(frozen=True)
class RayTrainResult:
    """A trained model folder and where its run is recorded."""

    model_dir: Path  # models/<attention>/ on the driver
    run_name: str  # Ray Train run and MLflow run name
    mlflow_run_id: str | None
    metrics: dict[str, Any]  # train_metrics.json


@dataclass(frozen=True)
class WorkerHooks:
    """Test seams every worker calls: faults are injected here (kills, raised errors)."""

    on_epoch_start: Callable[[WorkerRun, int], None] | None = None  # (run, 0-based epoch)
    on_step: Callable[[WorkerRun, int, int], None] | None = None  # (run, epoch, step)
    log_every: int = 50  # steps between on_step calls (and the loop's on_log)


@dataclass(frozen=True)
class StagedInputs:
    """The worker inputs the driver uploaded to storage (``ray.worker_inputs``): the manifest
    (name -> content address) each worker downloads before training."""

    manifest: Mapping[str, str]
    storage: Storage


@dataclass(frozen=True)
class TrainJob:
    """What every worker of a ``train_model`` run is given: the one worker config that the
    ``train`` stage, each Tune trial and ``benchmarks/bench_ray_train.py`` build."""

    params: Params
    attention: str
    prepared_dir: Path  # absolute: Ray workers change cwd
    features_dir: Path
    resume_from: Path | None = None  # a checkpoint folder seeding a new run
    identity: str | None = None  # recorded in config.json (pipeline.tracking.run_identity)
    run: Run | None = None  # rank 0 logs each epoch to it when set
    logged_params: Mapping[str, Any] = field(default_factory=dict)
    hooks: WorkerHooks = WorkerHooks()
    # None: workers open prepared_dir/features_dir (shared); else fetched from storage
    staged_inputs: StagedInputs | None = None
    # the driver's progress queue (pipeline.ray.progress): rank 0 reports within each epoch
    progress_queue: Any = None

    def with_local_inputs(self, into: Path) -> TrainJob:
        """This job reading a local copy of the staged inputs (fetched into ``into``), or
        itself when the workers share the driver's folders."""
        if self.staged_inputs is None:
            return self
        fetch_inputs(self.staged_inputs.manifest, self.staged_inputs.storage, into)
        return replace(
            self,
            prepared_dir=into / "prepared",
            features_dir=into / "features",
            staged_inputs=None,
        )

    def train(self, run: WorkerRun, out_dir: Path, callbacks: Sequence[Callback]) -> Any:
        """``train_model`` on this worker's shard, continuing ``run.resume_dir`` if any."""
        from sat_model.train.run import train_model

        return train_model(
            self.params,
            self.attention,
            prepared_dir=self.prepared_dir,
            features_dir=self.features_dir,
            out_dir=out_dir,
            rank=run.rank,
            world_size=run.world_size,
            device=run.device,
            callbacks=callbacks,
            resume_from=run.resume_dir or self.resume_from,
            wrap_model=run.wrap_model,
            identity=self.identity,
            log_every=self.hooks.log_every,
        )


class _RayEpochReporter(Callback):
    """``sat_model.train.trainer`` callback: each epoch to Ray (checkpoint from rank 0) and
    MLflow."""

    def __init__(self, run: WorkerRun, model_dir: Path, logger: Any | None) -> None:
        self.run, self.model_dir, self.logger = run, model_dir, logger
        self.hooks: WorkerHooks = run.config.hooks

    def on_epoch_start(self, epoch: int, num_batches: int | None) -> None:
        if self.hooks.on_epoch_start is not None:
            self.hooks.on_epoch_start(self.run, epoch)

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        if self.hooks.on_step is not None:
            self.hooks.on_step(self.run, epoch, step)

    def on_epoch_end(self, state: EpochState) -> None:
        metrics = {"train_loss": state.train_loss, "lr": state.lr}
        metrics.update({f"val_{k}": v for k, v in (state.val_metrics or {}).items()})
        if self.logger is not None:
            self.logger.log_epoch(state.epoch, metrics)  # step=epoch, once across restarts
        # what the driver's progress line sums over ranks (pipeline.ray.progress.EpochReport)
        throughput = {
            "captions": state.captions,
            "train_seconds": state.train_seconds,
            "epoch_seconds": state.seconds,
        }
        # train_model has rewritten model_dir (best checkpoint, metrics, curves) before this runs
        self.run.report({"epoch": state.epoch, **metrics, **throughput}, self.model_dir)


def sat_train_fn(run: WorkerRun) -> None:
    """Every worker: ``run.config`` (a :class:`TrainJob`) on this rank's shard; rank 0 reports
    the model folder each epoch."""
    from pipeline.ray.progress import BatchSender
    from pipeline.tracking.runs import flatten

    job: TrainJob = run.config
    resume = run.resume_dir or job.resume_from
    logger = None
    if run.rank == 0 and job.run is not None:
        job.run.log_params(flatten(dict(job.logged_params)))
        logger = job.run.epochs()
    with tempfile.TemporaryDirectory(prefix="sat-train-") as out:
        job = job.with_local_inputs(Path(out) / "inputs")
        model_dir = Path(out) / job.attention
        if run.rank == 0 and resume is not None:
            # a resumed run may not beat the best epoch again: keep its files in what we report
            shutil.copytree(resume, model_dir)
        callbacks: list[Callback] = [_RayEpochReporter(run, model_dir, logger)]
        if run.rank == 0 and job.progress_queue is not None:
            callbacks.append(BatchSender(job.progress_queue, run.world_size))
        job.train(run, Path(out), callbacks)


def stage_worker_inputs(
    storage: Storage, share: bool, prepared: Path, features: Path, mirrored: bool = False
) -> StagedInputs | None:
    """Where workers find their inputs: None when they open the driver's paths (``share``);
    else the files a training run reads (captions, vocabulary, the train and val feature stores,
    and with ``mirrored`` the mirrored train store) uploaded to ``storage`` by content, with the
    manifest each worker downloads."""
    if share:
        return None
    files = {
        f"prepared/{CAPTIONS_FILE}": prepared / CAPTIONS_FILE,
        f"prepared/{VOCAB_FILE}": prepared / VOCAB_FILE,
    }
    stores = [store_file("train"), store_file("val")]
    if mirrored:  # train.mirror > 0: the extract stage's store of the mirrored train photos
        stores.append(store_file("train", mirrored=True))
    files.update({f"features/{name}": features / name for name in stores})
    return StagedInputs(upload_inputs(files, storage), storage)


RUN_RECORD = "sat_run.json"  # in a run's storage folder: its identity, status, checkpoint


@dataclass(frozen=True)
class _Attempt:
    """One earlier run of an identity in Ray's storage, with what the driver recorded of it."""

    number: int
    folder: Storage  # <storage>/<name>
    record: dict[str, Any]  # RUN_RECORD's content, {} when unreadable

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def checkpoint(self) -> Storage | None:
        """The final checkpoint of a finished run that is still in storage, else None."""
        relative = self.record.get("checkpoint")
        if self.record.get("status") != "FINISHED" or not relative:
            return None
        path = self.folder.child(*Path(relative).parts)
        return path if path.is_dir() else None


def _attempts(storage: Storage, base: str) -> list[_Attempt]:
    """The runs called ``<base>-<n>`` under ``storage``, by attempt number."""
    found = []
    for folder in storage.subdirs():
        suffix = folder.name.removeprefix(f"{base}-")
        if folder.name.startswith(f"{base}-") and suffix.isdigit():
            found.append(_Attempt(int(suffix), folder, _read_record(folder.child(RUN_RECORD))))
    return sorted(found, key=lambda a: a.number)


def _read_record(file: Storage) -> dict[str, Any]:
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError):  # missing (FileNotFoundError is an OSError) or not JSON
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(storage: Storage, name: str, record: Mapping[str, Any]) -> None:
    storage.child(name, RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


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
    hooks: WorkerHooks = WorkerHooks(),
) -> RayTrainResult:
    """The ``train`` stage: Ray Train over ``train_model``, MLflow run, ``models/<attention>/``.

    ``project_root`` anchors every relative path in params (workers get absolute ones).
    ``resume`` continues the latest unfinished run of this identity; ``resume_from`` seeds a new
    run from a checkpoint folder (its content is part of the identity); ``hooks`` run on every
    worker (tests inject faults there).
    """
    from pipeline.ray.runtime import resolve_storage_path
    from pipeline.tracking.lineage import tag_trained_checkpoint
    from pipeline.tracking.run_identity import train_identity
    from pipeline.tracking.runs import connect

    root = project_root.resolve()
    prepared = absolute(params.data.prepared_dir, root)
    features = absolute(params.encoder.features_dir, root)
    seed = [resume_from.resolve()] if resume_from else []
    inputs = [prepared / CAPTIONS_FILE, prepared / VOCAB_FILE, features, *seed]
    identity = train_identity(params, attention, root, inputs=inputs)
    storage = resolve_storage_path(params.ray, root)
    base = f"sat-{attention}-{identity.short}"
    name, done = _choose_run(_attempts(storage, base), base, attention, resume)
    model_dir = output_path(params.train.models_dir, root) / attention
    if done is not None:
        checkpoint, run_id = done.checkpoint, done.record.get("mlflow_run_id")
    else:
        share = workers_share_files(params.ray.worker_inputs, storage)
        job = TrainJob(
            params,
            attention,
            prepared,
            features,
            resume_from=seed[0] if seed else None,
            identity=identity.digest,
            hooks=hooks,
            staged_inputs=stage_worker_inputs(
                storage, share, prepared, features, mirrored=params.train.mirror > 0
            ),
        )
        checkpoint, run_id = _fit_run(job, root, name, identity, address)
    assert checkpoint is not None  # _choose_run returns an attempt that has a checkpoint
    copy_checkpoint(checkpoint, model_dir)
    if run_id:  # how `register` finds the training run of the model it registers
        tag_trained_checkpoint(connect(params.mlflow, root), run_id, model_dir)
    metrics_file = model_dir / TRAIN_METRICS_FILE
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    return RayTrainResult(model_dir, name, run_id, metrics)


def _fit_run(
    job: TrainJob, root: Path, name: str, identity: RunIdentity, address: str | None
) -> tuple[Storage, str]:
    """Run (or resume) the Ray Train run ``name`` under its MLflow run; (checkpoint, run id)."""
    from pipeline.ray.progress import epoch_progress
    from pipeline.ray.runtime import ray_session, resolve_storage_path
    from pipeline.tracking.lineage import lineage_tags
    from pipeline.tracking.runs import connect

    params, attention = job.params, job.attention
    lineage = lineage_tags(
        root, prepared_dir=params.data.prepared_dir, features_dir=params.encoder.features_dir
    )
    tracking = connect(params.mlflow, root)
    warn_if_tracking_is_driver_only(tracking.tracking_uri, job.staged_inputs is not None)
    tags = {"sat.attention": attention, "sat.identity": identity.digest, **lineage}
    run = tracking.start_run(name, tags=tags)
    storage = resolve_storage_path(params.ray, root)
    record = {"identity": identity.digest, "inputs": identity.inputs, "mlflow_run_id": run.run_id}
    _write_record(storage, name, {**record, "status": "RUNNING"})
    job = replace(
        job,
        run=run,
        logged_params={"attention": attention, **identity.inputs["params"]},
    )
    cfg = getattr(params.train, attention)
    max_epochs = cfg.max_epochs + cfg.scst_epochs  # the self-critical epochs follow on
    try:
        with (
            ray_session(params.ray, address=address),
            epoch_progress(
                f"train {attention}", max_epochs, likelihood_epochs=cfg.max_epochs
            ) as progress,
        ):
            outcome = fit_on_ray(
                sat_train_fn,
                config=replace(job, progress_queue=progress.queue),
                run_name=name,
                storage_path=storage,
                scaling=ScalingSpec.from_params(params.ray),
                max_failures=params.ray.max_failures,
                callbacks=[progress.callback],
            )
    except BaseException:
        run.fail()
        raise
    if outcome.checkpoint is None:
        raise RuntimeError(f"Ray Train run {name} finished without a checkpoint")
    # relative to the run's folder: the project (or the bucket's mirror) may move
    checkpoint = os.path.relpath(outcome.checkpoint.path, outcome.storage_dir.path)
    finished = {**record, "status": "FINISHED", "checkpoint": checkpoint}
    _write_record(storage, name, finished)
    run.finish()
    return outcome.checkpoint, run.run_id


def warn_if_tracking_is_driver_only(tracking_uri: str, workers_elsewhere: bool) -> None:
    """One line on stderr when rank 0 may run on another node than a file-based MLflow store."""
    local = tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri
    if workers_elsewhere and local:
        _say(
            f"warning: mlflow tracking URI {tracking_uri} is a file on this machine; workers on "
            "other nodes cannot log to it: a cluster needs an MLflow tracking server "
            "(docs/guide/scaling-out.md)"
        )
