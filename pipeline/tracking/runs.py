"""MLflow tracking: which run a training resumes, and what each epoch logs.

Runs go to the store :mod:`pipeline.tracking.store` names. The driver creates (or finds, by its
deterministic name) a :class:`Run` for the Ray workers; rank 0 logs params and epochs through
:class:`EpochLogger`, which skips epochs the run holds, so a restarted worker never logs one
twice. :class:`Tracking` and :class:`Run` are the seam another backend implements.

Every call goes through :func:`with_retries` (SQLite under concurrent writers and a restarting
server fail transiently), and :func:`connect` bounds MLflow's own HTTP retries by
``mlflow.retries``, so a server that is down fails a command in seconds. What runs record about
their inputs is :mod:`pipeline.tracking.lineage`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from pipeline.settings import MlflowConfig
from pipeline.tracking.store import (
    artifact_location,
    bound_http_retries,
    redact,
    resolve_tracking_uri,
)

__all__ = [
    "ATTENTION_TAG",
    "CHECKPOINT_TAG",
    "EXPERIMENT_TAG",
    "GIT_COMMIT_TAG",
    "EpochLogger",
    "Run",
    "Tracking",
    "connect",
    "flatten",
    "with_retries",
]

T = TypeVar("T")

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests child runs under it
GIT_COMMIT_TAG = "mlflow.source.git.commit"  # MLflow's own tag: the UI shows it on the run
ATTENTION_TAG = "sat.attention"
CHECKPOINT_TAG = "sat.checkpoint_sha256"  # on a training run and on its registered version
EXPERIMENT_TAG = "sat.dvc_experiment"  # the DVC experiment a run or version came from
# Error codes of failures that another attempt may not meet (locked SQLite, server restarting).
_TRANSIENT_CODES = frozenset(
    {
        "INTERNAL_ERROR",
        "TEMPORARILY_UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "COULD_NOT_ACQUIRE_LOCK",
        "ABORTED",
        "IO_ERROR",
        "REQUEST_LIMIT_EXCEEDED",
    }
)


def _is_transient(err: BaseException) -> bool:
    if isinstance(err, MlflowException):
        return err.error_code in _TRANSIENT_CODES
    return isinstance(err, OSError)  # ConnectionError and socket timeouts are OSErrors


def with_retries(fn: Callable[[], T], *, retries: int, what: str, delay_s: float = 0.5) -> T:
    """Call ``fn``; retry transient tracking failures ``retries`` times with doubling delays."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    retrying = Retrying(
        retry=retry_if_exception(
            lambda e: isinstance(e, MlflowException | OSError) and _is_transient(e)
        ),
        stop=stop_after_attempt(retries + 1),
        wait=wait_exponential(multiplier=delay_s, exp_base=2, min=delay_s),  # 0.5, 1, 2 ... s
        reraise=True,
    )
    try:
        return retrying(fn)
    except (MlflowException, OSError) as err:
        tries = retrying.statistics.get("attempt_number", 1)
        err.add_note(f"tracking: {what} failed after {tries} attempt(s)")
        raise


@dataclass(frozen=True)
class Tracking:
    """A resolved tracking store and experiment, cheap to pass to Ray workers (plain fields)."""

    tracking_uri: str
    experiment_id: str
    experiment_name: str
    retries: int

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri)

    def call(self, fn: Callable[[MlflowClient], T], what: str) -> T:
        client = self.client()
        return with_retries(lambda: fn(client), retries=self.retries, what=what)

    def start_run(
        self, name: str, *, tags: Mapping[str, str] | None = None, parent: Run | None = None
    ) -> Run:
        """The newest run called ``name`` (under ``parent``), so a re-run resumes it, else a
        new one."""
        tags = dict(tags or {})
        query = f"attributes.run_name = '{name}'"
        if parent is not None:
            tags[PARENT_TAG] = parent.run_id
            query += f" and tags.`{PARENT_TAG}` = '{parent.run_id}'"

        def find_or_create(client: MlflowClient) -> str:
            runs = client.search_runs(
                [self.experiment_id], query, max_results=1, order_by=["start_time DESC"]
            )
            if runs:
                for key, value in tags.items():
                    client.set_tag(runs[0].info.run_id, key, value)
                return runs[0].info.run_id
            return client.create_run(self.experiment_id, tags=tags, run_name=name).info.run_id

        return Run(self, self.call(find_or_create, f"run {name!r}"))


@dataclass(frozen=True)
class Run:
    """One tracked run: plain fields, so it travels to Ray workers."""

    tracking: Tracking
    run_id: str

    def log_params(self, params: Mapping[str, str]) -> None:
        """Log the params the run does not hold yet (MLflow refuses to change a logged one)."""

        def log(client: MlflowClient) -> None:
            held = client.get_run(self.run_id).data.params
            new = [Param(k, v) for k, v in params.items() if k not in held]
            for i in range(0, len(new), 100):  # log_batch takes at most 100 params per call
                client.log_batch(self.run_id, params=new[i : i + 100])

        self.tracking.call(log, f"params of run {self.run_id}")

    def log_metric(self, key: str, value: float) -> None:
        self.tracking.call(lambda c: c.log_metric(self.run_id, key, value), f"log {key}")

    def epochs(self) -> EpochLogger:
        """Per-epoch metrics, each epoch at most once across restarts."""
        return EpochLogger(self.tracking, self.run_id)

    def children(self) -> list[tuple[Run, dict[str, str]]]:
        """The runs started under this one, each with its tags."""
        query = f"tags.`{PARENT_TAG}` = '{self.run_id}'"
        found = self.tracking.call(
            lambda c: c.search_runs([self.tracking.experiment_id], query), "child runs"
        )
        return [(Run(self.tracking, r.info.run_id), dict(r.data.tags)) for r in found]

    def finish(self) -> None:
        self._end("FINISHED")

    def fail(self) -> None:
        self._end("FAILED")

    def _end(self, status: str) -> None:
        self.tracking.call(
            lambda c: c.set_terminated(self.run_id, status), f"end run {self.run_id}"
        )


def connect(cfg: MlflowConfig, project_root: Path, experiment: str | None = None) -> Tracking:
    """Resolve the store and get or create the experiment (artifacts under the project)."""
    bound_http_retries(cfg.retries)
    # a new SQLite store logs its schema migrations at INFO: noise in every first stage's output
    for logger in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    uri = resolve_tracking_uri(cfg, project_root)
    if redact(uri) != uri:
        # MLflow prints "View run at <tracking URI>/#/..." when a run ends: not with a secret
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    name = experiment or cfg.experiment
    client = MlflowClient(tracking_uri=uri)

    def get_or_create() -> str:
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(name, artifact_location(cfg, project_root, uri))
        except MlflowException as err:  # another process created it between the two calls
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            created = client.get_experiment_by_name(name)
            assert created is not None  # RESOURCE_ALREADY_EXISTS: it is there now
            return created.experiment_id

    exp_id = with_retries(get_or_create, retries=cfg.retries, what=f"experiment {name!r}")
    return Tracking(uri, exp_id, name, cfg.retries)


def flatten(tree: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow params are flat strings."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


class EpochLogger:
    """Per-epoch metrics (``step=epoch``), each (key, epoch) at most once, across restarts."""

    def __init__(self, tracking: Tracking, run_id: str) -> None:
        self.tracking = tracking
        self.run_id = run_id
        self._logged: dict[str, set[int]] = {}

    def _steps(self, client: MlflowClient, key: str) -> set[int]:
        # read the run's history once per key: a resumed worker learns what an earlier one logged
        if key not in self._logged:
            history = client.get_metric_history(self.run_id, key)
            self._logged[key] = {m.step for m in history}
        return self._logged[key]

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Log what this epoch has not logged yet; return what was logged now."""

        def log(client: MlflowClient) -> dict[str, float]:
            now = int(time.time() * 1000)
            fresh = {k: float(v) for k, v in metrics.items() if epoch not in self._steps(client, k)}
            batch = [Metric(k, v, now, epoch) for k, v in fresh.items()]
            if batch:
                client.log_batch(self.run_id, metrics=batch)
            for key in fresh:
                self._logged[key].add(epoch)
            return fresh

        return self.tracking.call(log, f"epoch {epoch} metrics of run {self.run_id}")
