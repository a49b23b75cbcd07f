"""A trained project moves and is copied: each place captions with its own artifacts.

The project is a folder as ``make run`` leaves it for these commands: ``params.yaml``, the
SQLite store ``mlflow.db`` and ``mlartifacts/`` holding a registered champion (a tiny model over
the seeded ``random`` encoder, logged and registered as the register stage does). It is moved
with ``mv`` and the moved project copied with ``cp -r``; ``sat caption`` runs in each as a user
runs it (a subprocess, the champion by default, a photo of the Flickr8k sample).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tracking.relocation import URI_COLUMNS
from tests.factories import photo_of_another_shape, registered_project

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]
SAT = Path(sys.executable).with_name("sat")


def _caption(project: Path, photo: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run(
        [str(SAT), "caption", str(photo)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _locations(project: Path) -> set[str]:
    """Every artifact location the project's store records."""
    found = set()
    with sqlite3.connect(project / "mlflow.db") as con:
        for table, column in URI_COLUMNS:
            found |= {row[0] for row in con.execute(f"SELECT {column} FROM {table}") if row[0]}
    return {uri for uri in found if uri.startswith("file:")}


def test_a_moved_and_a_copied_project_caption_with_their_own_artifacts(tmp_path: Path) -> None:
    photo = photo_of_another_shape()
    original = registered_project(tmp_path / "original")
    moved, copied = tmp_path / "moved", tmp_path / "elsewhere" / "copied"
    assert _locations(original) and all(
        u.startswith(f"{original.as_uri()}/mlartifacts") for u in _locations(original)
    )

    shutil.move(original, moved)
    shutil.copytree(moved, copied)
    for project in (moved, copied):
        done = _caption(project, photo)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{photo}: "), done.stdout
        assert len(done.stdout.split(": ", 1)[1].split()) == 4  # max_length words
        # each store names its own artifacts now, none of another folder's
        own = f"{project.as_uri()}/mlartifacts"
        assert all(u.startswith(own) for u in _locations(project)), _locations(project)

    shutil.rmtree(moved)  # the copy's source is gone: the copy does not need it
    done = _caption(copied, photo)
    assert done.returncode == 0, done.stderr
    assert not moved.exists()  # and nothing recreated it


def test_a_store_shared_through_the_environment_is_not_rebased(tmp_path: Path, monkeypatch) -> None:
    """Project ``b`` logs to project ``a``'s store (``MLFLOW_TRACKING_URI``), its artifacts in
    its own folder: opening the store from ``a`` leaves ``b``'s locations as they are, and so
    does a profile inside ``a`` whose artifacts ``a``'s store records."""
    from pipeline.settings import MlflowConfig
    from pipeline.tracking.relocation import follow_project
    from pipeline.tracking.runs import connect

    a, b, profile = tmp_path / "a", tmp_path / "b", tmp_path / "a" / "profiles" / "mine"
    for root in (a, b, profile):
        (root / "mlartifacts").mkdir(parents=True)
    connect(MlflowConfig(), a)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{a / 'mlflow.db'}")
    connect(MlflowConfig(experiment="b"), b)
    connect(MlflowConfig(experiment="profile"), profile)
    before = _locations(a)
    assert {f"{root.as_uri()}/mlartifacts" for root in (a, b, profile)} <= before

    assert follow_project(a / "mlflow.db", a / "mlartifacts", a) == []
    assert _locations(a) == before
