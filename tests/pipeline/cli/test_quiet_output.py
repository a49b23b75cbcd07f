"""What a run prints is its result or one line: no library's error line or warning.

``sat caption DIR --engine ray --out`` a folder of other files is refused in one line, touching
nothing; ``mlflow.pyfunc.load_model`` of a registered champion (MLflow warns about a
``predict`` without type hints) warns about nothing; each in a subprocess as a user runs it. A
successful ``sat caption --engine ray`` on a local Ray, run twice into one folder, prints its
result only and names its files the same: test_one_caption_everywhere checks it on its run.
"""

from __future__ import annotations

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


def test_caption_on_ray_refuses_an_out_folder_that_holds_other_files(
    tmp_path: Path,
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "one.jpg").symlink_to(photo_of_another_shape())
    model = write_tiny_model(tmp_path / "model", words=("a", "dog", "runs"), resize=72)
    command = [str(SAT), "caption", "photos", "--engine", "ray", "--model", str(model)]
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
