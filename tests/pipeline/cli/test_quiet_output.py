"""What a successful run prints is its result: no library's error line or warning.

``sat caption DIR --engine ray`` on a local Ray (Ray Data's actor pools make Ray's core log an
error line about restarts on every run), twice into the same folder (deterministic output
names: the second run replaces the first's file); and ``mlflow.pyfunc.load_model`` of a
registered champion (MLflow warns about a ``predict`` without type hints), each in a
subprocess as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import photo_of_another_shape, registered_project, write_tiny_model

SAT = Path(sys.executable).with_name("sat")
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_ADDRESS"))}


@pytest.mark.ray
def test_caption_on_ray_prints_only_its_result_and_names_its_files_the_same(
    tmp_path: Path,
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "one.jpg").symlink_to(photo_of_another_shape())
    model = write_tiny_model(tmp_path / "model", words=("a", "dog", "runs"), resize=72)
    (tmp_path / "params.yaml").write_text("encoder: {name: random}\nray: {num_cpus: 2}\n")
    command = [str(SAT), "caption", "photos", "--engine", "ray", "--model", str(model)]
    for _ in range(2):
        done = subprocess.run(
            [*command, "--out", "captions"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", done.stderr  # Ray's core error line among others
        assert done.stdout.startswith("captioned 1 of 1 images into ")
        assert sorted(p.name for p in (tmp_path / "captions").iterdir()) == ["captions_000000.json"]
    (row,) = map(
        json.loads, (tmp_path / "captions" / "captions_000000.json").read_text().splitlines()
    )
    assert row["error"] is None and row["caption"]

    refused = subprocess.run(
        [*command, "--out", "photos"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        f"sat caption: error: refusing to write captions into {photos}: it holds other files "
        "(one.jpg, ...); name a new folder or prefix with --out"
    ]
    assert [p.name for p in photos.iterdir()] == ["one.jpg"]


@pytest.mark.mlflow
def test_loading_the_registered_model_with_mlflow_warns_about_nothing(tmp_path: Path) -> None:
    project = registered_project(tmp_path / "project")
    load = (
        "import mlflow; "
        f"mlflow.set_tracking_uri('sqlite:///{project / 'mlflow.db'}'); "
        "mlflow.pyfunc.load_model('models:/sat-captioner@champion')"
    )
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", load],
        cwd=project,
        env={**_env(), "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "UserWarning" not in done.stderr, done.stderr
