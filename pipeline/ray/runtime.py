"""Where Ray runs: a local ``ray.init`` by default, an existing cluster when an address is given.

The address comes from, in order: an explicit argument (``sat tune --address``), ``RAY_ADDRESS``,
``ray.address`` in params; with none of them Ray starts locally with ``ray.num_cpus`` CPUs. The
dashboard and usage statistics are off, logs are quiet and Ray Train starts no preemption watcher
unless the user asks otherwise.

A single-machine Ray must stay on loopback: Ray rewrites ``127.0.0.1`` to the machine's network
address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set, so :func:`loopback_env` sets it
(for this process before Ray is imported, and for ``ray start`` subprocesses).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.ray.storage import Storage, resolve_storage
from pipeline.settings import RayConfig

__all__ = [
    "RaySession",
    "loopback_env",
    "ray_session",
    "remove_orphaned_placement_groups",
    "resolve_address",
    "resolve_storage_path",
    "resolve_use_gpu",
    "without_core_lines",
]

# Defaults a user may still override in the environment (setdefault, never overwrite).
_DEFAULT_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 as given (see module docstring)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # Train's print patch spams the driver's terminal
    # an actor per fit that waits for spot-instance preemption notices: a process (about a
    # second of CPU) that clusters this project starts have no use for (decisions/010)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


def loopback_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``base`` (default ``os.environ``) plus the Ray defaults above that it lacks."""
    env = dict(os.environ if base is None else base)
    for key, value in _DEFAULT_ENV.items():
        env.setdefault(key, value)
    return env


def _apply_loopback_env() -> None:
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)


# Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when ray is first imported: set it now, as
# every Ray-using module of the pipeline imports this one before it imports ray.
_apply_loopback_env()


def resolve_address(cfg: RayConfig, address: str | None = None) -> str | None:
    """The cluster to connect to; None (or "local") means a local ``ray.init``."""
    return address or os.environ.get("RAY_ADDRESS") or cfg.address or None


def resolve_use_gpu(setting: str) -> bool:
    """``ray.use_gpu``: "auto" is true exactly when this process sees CUDA."""
    if setting == "auto":
        import torch

        return torch.cuda.is_available()
    if setting in ("true", "false"):
        return setting == "true"
    raise ValueError(f"ray.use_gpu must be auto, true or false, got {setting!r}")


def resolve_storage_path(cfg: RayConfig, project_root: Path) -> Storage:
    """Where Ray Train/Tune keep runs: an object-store URI as given, a folder made absolute
    (workers change their cwd); see :mod:`pipeline.ray.storage`."""
    return resolve_storage(cfg.storage_path, project_root)


@dataclass(frozen=True)
class RaySession:
    """What :func:`ray_session` connected to."""

    address: str | None  # None: a local cluster this process started
    started_here: bool  # False when an already-initialised Ray was reused


@contextlib.contextmanager
def ray_session(
    cfg: RayConfig, *, address: str | None = None, quiet: bool = True
) -> Iterator[RaySession]:
    """Connect to (or start) Ray for the duration of the block.

    An already-initialised Ray in this process (a test session's shared cluster, a Tune trial)
    is reused and left running; a cluster started here is shut down on exit.
    """
    _apply_loopback_env()
    import ray

    target = resolve_address(cfg, address)
    if ray.is_initialized():
        yield RaySession(address=target, started_here=False)
        return
    level = logging.WARNING if quiet else logging.INFO
    if quiet:
        # a local ray.init announces on every run that token authentication is on (or off) for
        # a cluster that listens on 127.0.0.1 only and ends with this process: noise to a user
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
            logging.ERROR
        )
    if target and target != "local":  # "local" (as in ray.init) forces a fresh local cluster
        ray.init(address=target, logging_level=level, log_to_driver=not quiet)
    else:
        # its workers' ports (a Serve replica's among them) listen beyond 127.0.0.1 and take
        # pickles: token authentication, whatever RAY_AUTH_MODE says, as the head runs. Unset,
        # Ray turns it on for a new local cluster and creates the token if there is none.
        os.environ.pop("RAY_AUTH_MODE", None)
        ray.init(
            num_cpus=cfg.num_cpus,
            include_dashboard=False,
            logging_level=level,
            log_to_driver=not quiet,
        )
    try:
        yield RaySession(address=target, started_here=True)
    finally:
        ray.shutdown()


def _actor_created_groups() -> list[tuple[bytes, bool]]:
    """(id, creator dead) of this job's live, non-detached groups that an actor created."""
    import ray
    from ray._private.state import state
    from ray._raylet import ActorID, JobID
    from ray.core.generated import gcs_pb2

    job = ray.get_runtime_context().get_job_id()
    groups = []
    for blob in state._connect_and_get_accessor().get_placement_group_table():
        group = gcs_pb2.PlacementGroupTableData.FromString(blob)  # type: ignore[attr-defined]
        if (
            group.state != gcs_pb2.PlacementGroupTableData.REMOVED  # type: ignore[attr-defined]
            and not group.is_detached
            and JobID(group.creator_job_id).hex() == job
            and not ActorID(group.creator_actor_id).is_nil()
        ):
            groups.append((group.placement_group_id, group.creator_actor_dead))
    return groups


def remove_orphaned_placement_groups(*, wait_s: float = 0.0) -> list[str]:
    """Remove this job's placement groups whose creating actor has died; returns their ids.

    Ray Train V2's controller (an actor under each Tune trial) creates its workers' placement
    group. When Tune stops a trial (ASHA, or ``max_t`` reached before ``fit`` returned) it ends
    the trial actor and the controller dies with it without removing that group; Ray frees a
    group only once both its creating actor *and* its job are dead, so the CPUs stay reserved
    while the driver lives and the next trial waits for them forever. Train's own
    ``PlacementGroupCleaner`` should catch this but asks the state API, which needs the dashboard
    and a single Ray instance on the machine ("Found multiple active Ray instances" otherwise).
    Groups a driver created (Tune's trial groups) and detached or other jobs' groups are left
    alone. ``wait_s`` > 0 keeps polling until no actor-created group of this job is left (the
    end of a sweep, while the last trials' controllers are still dying) or the time is up.
    """
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed: list[str] = []
    deadline = time.monotonic() + wait_s
    while True:
        groups = _actor_created_groups()
        for group_id, creator_dead in groups:
            if creator_dead:
                remove_placement_group(PlacementGroup(PlacementGroupID(group_id)))
                removed.append(group_id.hex())
        if all(dead for _, dead in groups) or time.monotonic() >= deadline:
            return removed
        time.sleep(0.5)


@contextlib.contextmanager
def without_core_lines(marker: str) -> Iterator[None]:
    """Drop the lines of this process's stderr that contain ``marker`` for the block.

    Ray's C++ core worker writes some of its log lines straight to file descriptor 2, past
    Python's logging: a warning that Ray Data's own actor pools trigger on every run is one
    (``ERROR`` level, about a restart that never comes; the worker's log file keeps it). Every
    other line passes through, in order, once complete; the block's partial last line at its
    end.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    wanted = marker.encode()

    def forward() -> None:
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if wanted not in line:
                    os.write(saved, line)

    thread = threading.Thread(target=forward, name="sat-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last writer: the thread reads to the end, stops
        thread.join(timeout=10)
        os.close(saved)
