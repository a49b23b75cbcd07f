"""Stages write only their own outputs: one writer at a time (a lock shared by ``dvc repro`` and
``sat``), never over a folder sat did not write, never outside the project unless asked, and
temporary folders of killed writers are cleaned up by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.ray.train import copy_checkpoint
from pipeline.stages import OutputLocked, lock_path, output_lock
from pipeline.stages.evaluate import _write_gallery
from sat_model.atomic import ForeignFolderError
from sat_model.paths import PathError, output_path


def _checkpoint(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"format_version": 2, "model": {}}\n')
    return path


def _sat(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_copy_checkpoint_never_replaces_a_folder_sat_did_not_write(tmp_path: Path) -> None:
    home = tmp_path / "home"  # what `models_dir: ~` pointed at
    (home / "soft").mkdir(parents=True)
    (home / "soft" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFolderError, match="not written by sat"):
        copy_checkpoint(_checkpoint(tmp_path / "run", b"new"), home / "soft")
    assert (home / "soft" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in home.iterdir()) == ["soft"]  # no staging copy left behind


def test_copy_checkpoint_removes_a_killed_copys_temp_folder(tmp_path: Path) -> None:
    models = tmp_path / "models"
    _checkpoint(models / "soft", b"old")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)  # its PID now names no process (PIDs are not reused this soon)
    leftover = _checkpoint(models / f".soft.{dead.pid}.k1ll3d", b"half")
    copy_checkpoint(_checkpoint(tmp_path / "run", b"new"), models / "soft")
    assert not leftover.exists()
    assert (models / "soft" / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in models.iterdir()) == ["soft"]


def test_a_failed_gallery_leaves_no_temp_and_a_dead_ones_is_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    leftover = tmp_path / f".attention.{dead.pid}.abcd"
    leftover.mkdir()

    def crash(folder: Path) -> None:
        (folder / "000_image.png").write_bytes(b"png")
        raise RuntimeError("photo decoder died")

    with pytest.raises(RuntimeError, match="decoder died"):
        _write_gallery(tmp_path, crash)
    assert list(tmp_path.iterdir()) == []


def test_output_paths_stay_in_the_project_unless_absolute(tmp_path: Path) -> None:
    assert output_path("models", tmp_path) == tmp_path.resolve() / "models"
    assert output_path(str(tmp_path / "elsewhere"), tmp_path / "p") == tmp_path / "elsewhere"
    assert output_path("~", tmp_path) == Path.home().resolve()  # named by the user: allowed
    with pytest.raises(PathError, match="leaves the project root"):
        output_path("../outside", tmp_path / "p")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "params.yaml").write_text("train:\n  models_dir: models\n")
    return tmp_path


@pytest.mark.slow
def test_sat_train_refuses_a_foreign_models_dir_before_training(project: Path) -> None:
    (project / "mine" / "soft").mkdir(parents=True)
    (project / "mine" / "soft" / "thesis.tex").write_text("years of work")
    done = _sat(project, "train", "--attention", "soft", "-S", "train.models_dir=mine")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"train: error: refusing to replace {project / 'mine' / 'soft'}: it exists and was not "
        "written by sat (point the param at a new or sat-owned folder, or remove it yourself)"
    ]
    assert (project / "mine" / "soft" / "thesis.tex").read_text() == "years of work"
    done = _sat(project, "train", "--attention", "soft", "-S", "train.models_dir=../up")
    assert done.returncode == 1 and "leaves the project root" in done.stderr
    assert "Traceback" not in done.stderr


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pipeline.stages import output_lock
    with output_lock(Path(sys.argv[1]), "holder"):
        print("locked", flush=True)
        time.sleep(300)
    """
)


def _holder(output: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(output)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "output"),
    [
        (("train", "--attention", "soft"), "models/soft"),
        (("evaluate", "--attention", "hard"), "reports/hard"),
    ],
)
def test_a_second_writer_fails_at_once_while_another_holds_the_output(
    project: Path, command: tuple[str, ...], output: str
) -> None:
    holder = _holder(project / output)  # a dvc repro stage writing the same output
    try:
        start = time.monotonic()
        done = _sat(project, *command)
        elapsed = time.monotonic() - start
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{command[0]}: error: {project / output} is being written by another")
    assert str(lock_path(project / output)) in line
    assert elapsed < 60  # failed at once: no training or decoding started


def test_a_killed_holder_leaves_the_output_unlocked(tmp_path: Path) -> None:
    holder = _holder(tmp_path / "models" / "soft")
    with pytest.raises(OutputLocked), output_lock(tmp_path / "models" / "soft", "train"):
        pass
    os.kill(holder.pid, signal.SIGKILL)  # a hard kill: the kernel drops its flock
    holder.wait(timeout=30)
    with output_lock(tmp_path / "models" / "soft", "train"):
        assert lock_path(tmp_path / "models" / "soft").exists()
