"""A generic Ray Train wrapper (V2 API of the pinned Ray) around a plain training function.

Every worker of the driver's ``TorchTrainer`` runs ``train_fn(run: WorkerRun)``; :class:`WorkerRun`
is all the function sees of Ray: rank, world size, device, the checkpoint to resume from, a
``wrap_model`` hook (DDP: gloo on CPU, NCCL on GPU) and ``report`` (once per epoch; rank 0
attaches the checkpoint folder). A run started again with the same name and storage resumes from
its last reported checkpoint, as do Ray's own restarts after a worker failure. Nothing here is
specific to sat's model: :mod:`pipeline.ray.train` is the ``train`` stage's use of it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch

from pipeline.ray.runtime import loopback_env, resolve_use_gpu
from pipeline.ray.storage import AWS_ENV, Storage
from pipeline.settings import RayConfig

__all__ = [
    "RayFitResult",
    "ScalingSpec",
    "TrainFn",
    "WorkerRun",
    "deterministic_run_name",
    "fit_on_ray",
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
