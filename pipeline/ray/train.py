"""The ``train`` stage on Ray Train: ``train_model`` on every worker of the generic wrapper
(:mod:`pipeline.ray.fit`), rank 0 logging each epoch to MLflow, the final checkpoint copied into
``models/<attention>/``.

Runs are named after the run's identity (``pipeline.tracking.run_identity``) and an attempt
number (:mod:`pipeline.ray.attempts`); an invocation trains from epoch 1 unless a run of that
identity finished (it hands back that model) or ``resume=True`` names an unfinished one (it
continues from its last epoch).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from pipeline.ray.attempts import attempts, choose_run, say, write_record
from pipeline.ray.fit import ScalingSpec, WorkerRun, fit_on_ray
from pipeline.ray.storage import Storage, fetch_inputs, upload_inputs, workers_share_files
from pipeline.settings import Params
from pipeline.tracking.run_identity import RunIdentity
from sat_model.atomic import remove_dead_temps, replace_dir, temp_dir
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE
from sat_model.features.store import store_file
from sat_model.model.checkpoint import TRAIN_METRICS_FILE, is_checkpoint_dir
from sat_model.paths import absolute, output_path
from sat_model.train.trainer import Callback, EpochState

if TYPE_CHECKING:
    from pipeline.tracking.runs import Run

__all__ = [
    "RayTrainResult",
    "StagedInputs",
    "TrainJob",
    "WorkerHooks",
    "copy_checkpoint",
    "sat_train_fn",
    "stage_worker_inputs",
    "train_with_ray",
    "warn_if_tracking_is_driver_only",
]


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
        from sat_model.train.run import TrainFolders, Worker, train_model

        return train_model(
            self.params,
            self.attention,
            TrainFolders(self.prepared_dir, self.features_dir, out_dir),
            worker=Worker(run.rank, run.world_size, run.device, run.wrap_model),
            callbacks=callbacks,
            resume_from=run.resume_dir or self.resume_from,
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
    name, done = choose_run(attempts(storage, base), base, attention, resume)
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
    write_record(storage, name, {**record, "status": "RUNNING"})
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
    write_record(storage, name, finished)
    run.finish()
    return outcome.checkpoint, run.run_id


def warn_if_tracking_is_driver_only(tracking_uri: str, workers_elsewhere: bool) -> None:
    """One line on stderr when rank 0 may run on another node than a file-based MLflow store."""
    local = tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri
    if workers_elsewhere and local:
        say(
            f"warning: mlflow tracking URI {tracking_uri} is a file on this machine; workers on "
            "other nodes cannot log to it: a cluster needs an MLflow tracking server "
            "(docs/guide/scaling-out.md)"
        )
