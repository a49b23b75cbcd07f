"""The installed ``sat`` command as a user runs it: a subprocess per call, real Flickr8k photos.

The captioning model is tiny and untrained, over the seeded ``random`` encoder (its captions mean
nothing; one per photo is what is checked). Photos are symlinked from the Flickr8k sample
(``../shared/data/flickr8k-sample`` next to the repository); those tests skip without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline.cli.main import main
from sat_model.paths import shared_data
from tests.factories import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
SAT = Path(sys.executable).parent / "sat"
PARAMS = "encoder: {name: random, resize: 72, crop: 64}\neval: {beam_size: 2, max_length: 4}\n"

needs_photos = pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"no Flickr8k sample at {PHOTOS}")
needs_sat = pytest.mark.skipif(not SAT.exists(), reason=f"no sat command next to {sys.executable}")
pytestmark = needs_sat


def _sat(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run(
        [str(SAT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _photos(n: int) -> list[Path]:
    return sorted(PHOTOS.glob("*.jpg"))[:n]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with params.yaml and a tiny soft model in models/soft (no MLflow store)."""
    root = tmp_path_factory.mktemp("sat_command")
    write_tiny_model(root / "models" / "soft", words=("a", "dog", "runs"), resize=72)
    (root / "params.yaml").write_text(PARAMS)
    return root


def _jsonl(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


@needs_photos
def test_caption_a_folder_as_jsonl_writes_one_line_per_photo(workdir, tmp_path):
    photos = _photos(7)
    folder = tmp_path / "photos"
    (folder / "nested").mkdir(parents=True)
    for i, photo in enumerate(photos):  # recursion: some photos one folder down
        (folder / ("nested" if i % 2 else ".") / photo.name).symlink_to(photo)
    args = ["caption", str(folder), "--format", "jsonl", "--model", "models/soft"]
    done = _sat(*args, "--batch-size", "3", cwd=workdir)
    assert done.returncode == 0, done.stderr
    rows = _jsonl(done.stdout)
    assert sorted(Path(r["path"]).name for r in rows) == [p.name for p in photos]
    for row in rows:
        assert row["error"] is None
        assert len(str(row["caption"]).split()) == 4  # max_length words of the tiny vocabulary
    assert done.stderr == ""  # quiet: no warnings, no progress bar on a pipe


@needs_photos
def test_caption_keeps_going_past_a_corrupt_file_and_skips_non_images(workdir, tmp_path):
    good = _photos(2)
    for photo in good:
        (tmp_path / photo.name).symlink_to(photo)
    (tmp_path / "corrupt.jpg").write_bytes(good[0].read_bytes()[:2000])  # truncated JPEG
    (tmp_path / "notes.jpg").write_text("a text file named like a photo")
    (tmp_path / "README.txt").write_text("not an image extension: never read")
    args = ["caption", str(tmp_path), "--model", "models/soft"]
    done = _sat(*args, "--format", "jsonl", cwd=workdir)
    assert done.returncode == 0, done.stderr
    rows = {Path(str(r["path"])).name: r for r in _jsonl(done.stdout)}
    assert set(rows) == {good[0].name, good[1].name, "corrupt.jpg", "notes.jpg"}
    for name in ("corrupt.jpg", "notes.jpg"):
        assert rows[name]["caption"] is None
        assert str(rows[name]["error"]).startswith("cannot decode")
    assert all(rows[p.name]["caption"] and rows[p.name]["error"] is None for p in good)

    text = _sat(*args, cwd=workdir)
    assert text.returncode == 0
    assert sorted(line.split(": ")[0] for line in text.stdout.splitlines()) == sorted(
        str(tmp_path / p.name) for p in good
    )
    assert f"{tmp_path / 'corrupt.jpg'}: error: cannot decode" in text.stderr


@needs_photos
def test_caption_without_a_champion_says_what_to_do_in_one_line(tmp_path):
    done = _sat("caption", str(_photos(1)[0]), cwd=tmp_path)  # no params.yaml, no mlflow.db
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat caption: error: no champion model registered")
    assert "make run" in line and "--model models/soft" in line
    assert done.stdout == ""
    assert not (tmp_path / "mlflow.db").exists()  # looking for it created no store


def test_caption_of_a_folder_that_is_no_model_is_one_line(workdir):
    done = _sat("caption", "x.jpg", "--model", "models/absent", cwd=workdir)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "sat caption: error: models/absent is not a model folder (no model.pt in it)"
    ]


def test_a_bad_param_is_one_line_and_minus_v_shows_the_traceback(workdir):
    done = _sat("train", "--attention", "soft", "-S", "train.soft.lr=abc", cwd=workdir)
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat train: error: invalid params:") and "train.soft.lr" in line
    assert "Traceback" not in done.stderr

    verbose = _sat("-v", "train", "--attention", "soft", "-S", "train.soft.lr=abc", cwd=workdir)
    assert verbose.returncode != 0
    assert "Traceback (most recent call last)" in verbose.stderr
    assert "ParamsError" in verbose.stderr and "train.soft.lr" in verbose.stderr


def test_version_is_the_installed_distribution_version(tmp_path):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = _sat("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"sat {declared}"


def test_a_missing_params_file_is_one_line_for_every_command_that_reads_params(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # in process: the same main() as the command, without 3 starts
    for command in (["train", "--attention", "hard"], ["tune"], ["evaluate"]):
        assert main([*command, "--params", "absent.yaml"]) == 1, command
        assert capsys.readouterr().err.splitlines() == [
            f"sat {command[0]}: error: params file not found: absent.yaml"
        ]
