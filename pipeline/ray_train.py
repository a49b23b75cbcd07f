"""Ray Train (V2 API of the pinned Ray) around the plain, single-process training function.

The driver builds a ``TorchTrainer`` whose every worker runs a *train function*
``train_fn(run: WorkerRun) -> None``. :class:`WorkerRun` is all the function sees of Ray: its
rank and world size, the device Ray placed it on, the local copy of the checkpoint to resume from,
a ``wrap_model`` hook (DDP via ``ray.train.torch.prepare_model``: gloo on CPU, NCCL on GPU) and
``report`` (every rank calls it once per epoch; rank 0 attaches the checkpoint directory). The run
has a deterministic name, so running it again with the same name and storage path resumes from
its last reported checkpoint (Ray Train V2 restores the run's checkpoint state from storage).

:func:`train_with_ray` is the ``train`` stage's use of it: ``sat_model.train_run.train_model`` on
every worker, rank 0 logging each epoch to MLflow once, the final checkpoint copied from Ray's
storage into ``models/<attention>/`` on the driver.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sat_model.config import RayConfig

from .ray_runtime import loopback_env, resolve_use_gpu

__all__ = [
    "FitOutcome",
    "ScalingSpec",
    "TrainFn",
    "WorkerRun",
    "copy_checkpoint",
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
        run_config=RunConfig(
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
    """Replace ``destination`` by a copy of ``source`` atomically (sibling temp dir, rename)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
        if destination.exists():
            old = destination.with_name(f".{destination.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            destination.rename(old)
            staging.rename(destination)
            shutil.rmtree(old)
        else:
            staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
