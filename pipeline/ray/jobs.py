"""``sat train`` / ``sat tune`` submitted to a Ray cluster as a Ray Job.

An address that is a dashboard URL (``--address http://head:8265``, or ``RAY_ADDRESS`` set to
one) means "run this on that cluster": :func:`run_as_job` submits the same ``sat`` command
through :class:`ray.job_submission.JobSubmissionClient` with a runtime environment that carries
the project's code (``working_dir``: the folder holding ``pipeline/`` and ``sat_model/``, without
virtual environments, data, models, results and caches), streams the job's log to this terminal
and returns the job's exit status. Inside the job the command connects to the cluster it runs on
(``--address auto``), as a local run would call ``ray.init``.

Data is not uploaded: the job opens the params file, and everything params name relative to it
(prepared tables, features, ``ray.storage_path``, the default SQLite tracking store), at the
project folder's absolute path, so that folder must be one every node sees (one machine, or a
shared file system); on a cluster without one the data goes to object storage
(docs/guide/scaling-out.md). Token authentication (``ray start`` enables it) needs
``RAY_AUTH_MODE=token`` here; the client then sends the token from ``~/.ray/auth_token`` (or
``RAY_AUTH_TOKEN``) with every request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EXCLUDES",
    "FORWARDED_ENV",
    "JobFailedError",
    "code_root",
    "is_jobs_address",
    "job_address",
    "job_runtime_env",
    "run_as_job",
]

# gitignore syntax, relative to working_dir: nothing heavy or generated goes up with the code
# (Ray itself leaves out .git, .venv, venv and __pycache__)
EXCLUDES = [
    ".dvc/cache/",
    ".dvc/tmp/",
    "data/",
    "models/",
    "reports/",
    "mlruns/",
    "mlartifacts/",
    "mlflow.db",
    "ray_results/",
    "benchmarks/results/",
    "dvc_plots/",
    ".pytest_cache/",
    ".ruff_cache/",
    ".mypy_cache/",
    "*.pt",
]

# what the job's processes need from this environment: loopback/quiet Ray settings, where MLflow
# and object storage are. The runtime env is readable by anyone who can see the dashboard, so no
# secret goes in it (a tracking URI's user:password@ is removed): credentials reach the job from
# the cluster's own environment, the one its nodes were started with (docs/guide/scaling-out.md)
FORWARDED_ENV = (
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_USAGE_STATS_ENABLED",
    "RAY_TRAIN_ENABLE_PRINT_PATCH",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
)
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


class JobFailedError(Exception):
    """The submitted job ended in FAILED or STOPPED; the message is the line ``sat`` prints."""


def is_jobs_address(address: str | None) -> bool:
    """A Ray dashboard URL (Ray Jobs), as opposed to a GCS address or ``auto``."""
    return bool(address) and address.startswith(("http://", "https://"))  # type: ignore[union-attr]


def job_address(address: str | None) -> str | None:
    """The dashboard URL to submit to: ``--address``, else ``RAY_ADDRESS``; None to run here."""
    target = address or os.environ.get("RAY_ADDRESS")
    return target if is_jobs_address(target) else None


def code_root() -> Path:
    """The folder holding the ``pipeline`` and ``sat_model`` packages (the job's working_dir)."""
    return Path(__file__).resolve().parents[2]


def job_runtime_env(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """``working_dir`` (the code, with :data:`EXCLUDES`) and the :data:`FORWARDED_ENV` set here,
    without credentials."""
    from pipeline.ray.runtime import loopback_env

    source = loopback_env(env)
    return {
        "working_dir": str(code_root()),
        "excludes": EXCLUDES,
        "env_vars": {
            k: _USERINFO.sub(r"\g<scheme>", source[k]) for k in FORWARDED_ENV if k in source
        },
    }


def _entrypoint(command: Sequence[str]) -> str:
    # `python -m pipeline.cli.main` from the working_dir: the uploaded code, not an installed copy
    return shlex.join(["python", "-m", "pipeline.cli", *command, "--address", "auto"])


def run_as_job(address: str, command: Sequence[str], *, quiet: bool = True) -> int:
    """Submit ``sat <command>`` to the cluster at ``address``; stream its log; 0 on success.

    A job that ends FAILED or STOPPED raises :class:`JobFailedError` after its log was shown.
    Ctrl-C stops the job before re-raising. ``quiet`` keeps Ray's client-side INFO and WARNING
    lines (packaging, upload, which folders Ray leaves out) off the terminal.
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    if quiet:  # Ray's SDK modules set their own loggers to INFO
        for name in ("ray", "ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk"):
            logging.getLogger(name).setLevel(logging.ERROR)
    client = JobSubmissionClient(address)
    job_id = client.submit_job(entrypoint=_entrypoint(command), runtime_env=job_runtime_env())
    print(f"sat: submitted Ray job {job_id} to {address}", file=sys.stderr, flush=True)
    try:
        asyncio.run(_stream_logs(client, job_id))
        status = _wait_terminal(client, job_id)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        print(f"sat: stopped Ray job {job_id}", file=sys.stderr, flush=True)
        raise
    if status == JobStatus.SUCCEEDED:
        return 0
    info = client.get_job_info(job_id)
    code = info.driver_exit_code or 1
    # Ray's message appends the job's last logs, which were streamed already
    first = (info.message or "").strip().partition("\n")[0].partition(", last available logs")[0]
    why = f": {first}" if first else ""
    raise JobFailedError(f"Ray job {job_id} {status.value} (exit status {code}){why}")


async def _stream_logs(client: object, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):  # type: ignore[attr-defined]
        sys.stdout.write(chunk)
        sys.stdout.flush()


def _wait_terminal(client: Any, job_id: str, timeout_s: float = 60.0) -> Any:
    """The job's final status; the log stream may close a moment before the status is final."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return status
        time.sleep(0.5)
