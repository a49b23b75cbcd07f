"""Writes are whole and durable: files and their folders are fsynced, a folder is swapped in one
rename, and temporary folders of dead writers are removed while a live writer's are kept."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sat_model import atomic
from sat_model.atomic import (
    ForeignFolderError,
    remove_dead_temps,
    replace_dir,
    temp_dir,
    write_text_atomic,
)
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureWriter


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """``(inode, is_folder)`` of every fd passed to ``os.fsync``; the real fsync still runs."""
    seen: list[tuple[int, bool]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        seen.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", spy)
    return seen


def test_an_atomic_write_fsyncs_the_file_then_its_folder(tmp_path: Path, fsynced) -> None:
    write_text_atomic(tmp_path / "out" / "metrics.json", "{}\n")
    file_ino = (tmp_path / "out" / "metrics.json").stat().st_ino
    folder_ino = (tmp_path / "out").stat().st_ino
    assert fsynced == [(file_ino, False), (folder_ino, True)]


def test_a_feature_store_is_fsynced_with_its_folder(tmp_path: Path, fsynced) -> None:
    spec = EncoderSpec("random", "conv", 32, 4, 3, 2, 2, "seed")
    with FeatureWriter(tmp_path / "train.arrow", spec) as writer:
        writer.write(["a"], np.ones((1, 4, 3), np.float32))
    assert ((tmp_path / "train.arrow").stat().st_ino, False) in fsynced
    assert fsynced[-1] == (tmp_path.stat().st_ino, True)


def _folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_replace_dir_swaps_whole_and_fsyncs_every_file(tmp_path: Path, fsynced) -> None:
    dst = _folder(tmp_path / "soft", {"model.pt": "old", "stale.json": "{}"})
    staging = _folder(temp_dir(tmp_path, "soft") / "x", {"model.pt": "new"}).parent
    new_ino = (staging / "x" / "model.pt").stat().st_ino
    replace_dir(staging, dst, owned=lambda p: True)
    assert (dst / "x" / "model.pt").read_text() == "new" and not (dst / "stale.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["soft"]  # the old one is gone
    assert (new_ino, False) in fsynced and fsynced[-1] == (tmp_path.stat().st_ino, True)


_POLLER = textwrap.dedent(
    """
    import os, sys, time
    path, deadline, missing = sys.argv[1], time.monotonic() + float(sys.argv[2]), 0
    print("ready", flush=True)
    while time.monotonic() < deadline:
        missing += not os.path.isdir(path)
    print(missing)
    """
)


@pytest.mark.slow
def test_the_model_folder_never_stops_existing_while_it_is_replaced(tmp_path: Path) -> None:
    dst = _folder(tmp_path / "soft", {"model.pt": "0"})
    poller = subprocess.Popen(
        [sys.executable, "-c", _POLLER, str(dst), "4"], stdout=subprocess.PIPE, text=True
    )
    assert poller.stdout is not None and poller.stdout.readline() == "ready\n"
    swaps = 0
    while poller.poll() is None and swaps < 2000:
        staging = temp_dir(tmp_path, "soft")
        (staging / "model.pt").write_text(str(swaps))
        replace_dir(staging, dst, owned=lambda p: True)
        swaps += 1
    out, _ = poller.communicate(timeout=30)
    assert swaps > 50, f"only {swaps} swaps while the reader polled"
    assert int(out) == 0, f"{dst} was missing {out.strip()} times in {swaps} swaps"


def test_a_folder_that_is_not_ours_is_never_replaced(tmp_path: Path) -> None:
    home = _folder(tmp_path / "home" / "soft", {"thesis.tex": "years of work"})
    staging = _folder(tmp_path / "home" / ".soft.1.x", {"model.pt": "new"})
    with pytest.raises(ForeignFolderError, match="not written by sat"):
        replace_dir(staging, home, owned=lambda p: (p / "model.pt").is_file())
    assert (home / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ForeignFolderError, match="not a folder"):
        replace_dir(staging, tmp_path / "file", owned=lambda p: True)


_WRITER = textwrap.dedent(
    """
    import sys, time
    from sat_model.atomic import temp_dir
    tmp = temp_dir(sys.argv[1], "soft")
    (tmp / "model.pt").write_bytes(b"half")
    print(tmp, flush=True)
    time.sleep(300)
    """
)


def _writer(parent: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(parent)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_dead_writers_temp_folder_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead, dead_tmp = _writer(tmp_path)
    live, live_tmp = _writer(tmp_path)
    try:
        os.kill(dead.pid, signal.SIGKILL)  # a hard kill: no cleanup of its own runs
        dead.wait(timeout=30)
        assert dead_tmp.is_dir() and live_tmp.is_dir()
        assert remove_dead_temps(tmp_path, "soft") == [dead_tmp]
        assert not dead_tmp.exists() and (live_tmp / "model.pt").read_bytes() == b"half"
    finally:
        os.kill(live.pid, signal.SIGKILL)
        live.wait(timeout=30)
    # the live writer is now dead too: the next writer takes its temp
    assert remove_dead_temps(tmp_path, "soft") == [live_tmp]


@pytest.mark.parametrize(
    ("umask", "folder", "file"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)]
)
def test_an_output_folder_and_file_take_the_umask_mode(tmp_path: Path, umask, folder, file) -> None:
    """A model folder swapped into place and an atomically written file get the mode any
    folder or file the user makes gets: readable by others under umask 022, not under 077."""
    previous = os.umask(umask)
    try:
        staging = temp_dir(tmp_path, "soft")
        write_text_atomic(staging / "config.json", "{}\n")
        replace_dir(staging, tmp_path / "soft", owned=lambda p: True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "soft").stat().st_mode) == folder
    assert stat.S_IMODE((tmp_path / "soft" / "config.json").stat().st_mode) == file
