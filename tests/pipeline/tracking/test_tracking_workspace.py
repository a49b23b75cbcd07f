"""Experiments run in DVC's temporary workspaces log to the project's own tracking store."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.settings import MlflowConfig
from pipeline.tracking.store import artifact_location, resolve_tracking_uri, tracking_root


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)


def test_a_temp_workspace_tracks_into_the_project_it_was_copied_from(tmp_path: Path) -> None:
    workspace = tmp_path / ".dvc" / "tmp" / "exps" / "tmpab12cd"
    workspace.mkdir(parents=True)
    assert tracking_root(workspace) == tmp_path.resolve()
    assert resolve_tracking_uri(MlflowConfig(), workspace) == f"sqlite:///{tmp_path}/mlflow.db"
    assert artifact_location(MlflowConfig(), workspace) == (tmp_path / "mlartifacts").as_uri()
    queued = tmp_path / ".dvc" / "tmp" / "exps" / "celery" / "tmpxyz" / "sub"
    assert tracking_root(queued) == tmp_path.resolve()


def test_dvc_root_names_the_project_of_a_temp_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DVC sets DVC_ROOT to the parent project for experiment runs (dvc/repo/experiments/queue)
    workspace = tmp_path / ".dvc" / "tmp" / "exps" / "tmp1"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking_root(workspace) == tmp_path.resolve()
    assert tracking_root(tmp_path / "proj") == (tmp_path / "proj").resolve()  # not a workspace


def test_a_relative_sqlite_uri_resolves_against_the_project(tmp_path: Path) -> None:
    relative = MlflowConfig(tracking_uri="sqlite:///runs/mlflow.db")
    assert resolve_tracking_uri(relative, tmp_path) == f"sqlite:///{tmp_path}/runs/mlflow.db"
    absolute = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path}/x.db")
    assert resolve_tracking_uri(absolute, tmp_path / "other") == f"sqlite:///{tmp_path}/x.db"
    server = MlflowConfig(tracking_uri="http://127.0.0.1:1")
    assert resolve_tracking_uri(server, tmp_path) == "http://127.0.0.1:1"


_STAGE = textwrap.dedent(
    """
    from pathlib import Path
    from pipeline.tracking.runs import connect
    from pipeline.settings import MlflowConfig
    tracking = connect(MlflowConfig(), Path.cwd())
    tracking.start_run("temp-workspace-run")
    Path("out.txt").write_text(tracking.tracking_uri)
    """
)


@pytest.mark.slow
@pytest.mark.mlflow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_dvc_exp_run_temp_logs_into_the_projects_mlflow_db(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "log_run.py").write_text(_STAGE)
    (project / "dvc.yaml").write_text(
        f"stages:\n  track:\n    cmd: {sys.executable} log_run.py\n"
        "    deps: [log_run.py]\n    outs: [out.txt]\n"
    )
    (project / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    dvc = [str(Path(sys.executable).with_name("dvc"))]
    for cmd in (
        ["git", "init", "-q"],
        [*dvc, "init", "-q"],
        ["git", "add", "-A"],
        [*git, "commit", "-qm", "tracking stage"],
        [*dvc, "exp", "run", "--temp"],
    ):
        done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{cmd}: {done.stdout}\n{done.stderr}"
    assert (project / "mlflow.db").is_file(), "the run went to the temp workspace's own store"
    with sqlite3.connect(project / "mlflow.db") as db:
        names = [row[0] for row in db.execute("select name from runs")]
    assert names == ["temp-workspace-run"]
