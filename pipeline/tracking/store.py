"""Where a project's MLflow tracking store is: ``MLFLOW_TRACKING_URI``, else
``mlflow.tracking_uri``, else ``sqlite:////<absolute project root>/mlflow.db``; where new
experiments keep their artifacts (on a tracking server, the server's own place unless
``mlflow.artifact_root`` is a URI); and the URI with its credentials removed, for anything
printed.

Plain paths and strings, without MLflow: a command checks that a local store exists before it
pays for importing MLflow (:mod:`pipeline.tracking.runs` connects to it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.settings import MlflowConfig
from pipeline.tracking.relocation import follow_project

__all__ = [
    "artifact_location",
    "bound_http_retries",
    "is_tracking_server",
    "redact",
    "resolve_tracking_uri",
    "tracking_root",
]

# setdefault, never overwrite: MLflow's own per-request HTTP retries, bounded by
# ``mlflow.retries`` (backoff factor 1: 1 + 2 + 4 s ... between tries), each try at most 20 s,
# so a tracking server that is down fails a command in seconds, not MLflow's default 4 minutes
_HTTP_BACKOFF_FACTOR = "1"
_HTTP_TIMEOUT_S = "20"
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL replaced by ``***@``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def bound_http_retries(retries: int) -> None:
    """Cap MLflow's HTTP retries at ``retries`` and its timeout for this process (user
    settings win)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", _HTTP_BACKOFF_FACTOR)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", _HTTP_TIMEOUT_S)


def tracking_root(project_root: Path) -> Path:
    """The project whose tracking store runs go to: ``project_root``, except in a DVC
    experiment's temporary workspace (``dvc exp run --temp`` / ``--queue`` run in a copy under
    ``<project>/.dvc/tmp/exps/<tmp>/``, deleted afterwards), where it is the project the copy was
    made from: ``DVC_ROOT``, which DVC sets to that project for experiment runs, else the folder
    above ``.dvc`` in the path."""
    root = Path(project_root).resolve()
    dvc_root = os.environ.get("DVC_ROOT")
    if dvc_root and root.is_relative_to(Path(dvc_root).resolve() / ".dvc" / "tmp" / "exps"):
        return Path(dvc_root).resolve()
    parts = root.parts
    starts = [i for i in range(len(parts) - 2) if parts[i : i + 3] == (".dvc", "tmp", "exps")]
    return Path(*parts[: starts[0]]) if starts else root


def resolve_tracking_uri(cfg: MlflowConfig, project_root: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else params, else an absolute SQLite file in the project.

    A relative SQLite path (``sqlite:///mlflow.db``) resolves against :func:`tracking_root`, so
    that experiments in DVC's temporary workspaces log to the project's own store. A SQLite
    store inside the project that was moved or copied with it is first rebased onto it
    (:mod:`pipeline.tracking.relocation`).
    """
    bound_http_retries(cfg.retries)  # every command that reaches the store goes through here
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri
    if uri and not uri.startswith("sqlite:///"):
        return uri
    if not uri or not uri.startswith("sqlite:////"):
        path = uri[len("sqlite:///") :] if uri else "mlflow.db"
        # four slashes: sqlite:/// + an absolute path; workers run elsewhere, never relative
        uri = f"sqlite:///{(tracking_root(project_root) / path).resolve()}"
    artifacts = _local_artifact_root(cfg, project_root)
    if artifacts is not None:  # a store moved or copied with its project reads its own files
        follow_project(Path(uri[len("sqlite:///") :]), artifacts, tracking_root(project_root))
    return uri


def is_tracking_server(uri: str) -> bool:
    """True for a remote tracking server (``http(s)://``, ``databricks``), not a local store."""
    return uri.split(":", 1)[0].lower() in ("http", "https", "databricks")


def artifact_location(
    cfg: MlflowConfig, project_root: Path, tracking_uri: str | None = None
) -> str | None:
    """Artifact location (a URI) for experiments this project creates; ``None`` on a tracking
    server when ``artifact_root`` is a local path: the server's own default (its proxied
    ``--artifacts-destination``), since a client's folder is nowhere a teammate can read."""
    if "://" in cfg.artifact_root:
        return cfg.artifact_root
    if tracking_uri is not None and is_tracking_server(tracking_uri):
        return None
    root = _local_artifact_root(cfg, project_root)
    assert root is not None  # not a URI: a folder
    return root.as_uri()


def _local_artifact_root(cfg: MlflowConfig, project_root: Path) -> Path | None:
    """``mlflow.artifact_root`` as an absolute folder (relative ones in the project), ``None``
    for a URI."""
    if "://" in cfg.artifact_root:
        return None
    root = Path(cfg.artifact_root).expanduser()
    return (root if root.is_absolute() else tracking_root(project_root) / root).resolve()
