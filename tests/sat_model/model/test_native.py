"""The compiled kernels' build (``sat_model.model.kernels.native``).

Where there is a compiler the library builds once and is reused; a missing or broken compiler
leaves one warning line; loading the library leaves the process's float mode alone; processes
that build at once share one library. What the kernels compute is held to the readable model in
``test_backend.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sat_model.model.kernels import native

HAS_COMPILER = shutil.which(os.environ.get("CXX") or "c++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH")


@pytest.fixture(autouse=True)
def fresh_load() -> Iterator[None]:
    """Each test loads (or refuses) the kernels under its own environment."""
    native.load.cache_clear()
    yield
    native.load.cache_clear()


@pytest.mark.slow
@needs_compiler
def test_the_kernels_build_where_there_is_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels = native.load()
    assert kernels is not None and kernels.sgemm is not None
    built = list(native.cache_dir().glob("sat_kernels_*/sat_kernels_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.load.cache_clear()  # a second load: the built library, not a second build
    assert native.load() is not None
    assert [p.stat().st_mtime_ns for p in native.cache_dir().glob("*/*.so")] == [stamp]


@pytest.mark.slow
@needs_compiler
def test_another_checkout_of_the_same_source_loads_the_built_library(tmp_path: Path) -> None:
    """A project copy or a worktree holds the same source at another path: its processes load
    the library that the first checkout's process built instead of building it again."""
    other = tmp_path / "other-checkout" / native.SOURCE.name
    other.parent.mkdir()
    shutil.copy2(native.SOURCE, other)
    script = (
        "import sys\nfrom pathlib import Path\nfrom sat_model.model.kernels import native\n"
        "native.SOURCE = Path(sys.argv[1])\nassert native.load() is not None\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    built: list[list[tuple[Path, int]]] = []
    for source in (native.SOURCE, other, native.SOURCE):
        run = subprocess.run(
            [sys.executable, "-c", script, str(source)], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        libraries = (tmp_path / "cache" / "sat" / "kernels").glob("*/*.so")
        built.append([(p, p.stat().st_mtime_ns) for p in libraries])
    assert len(built[0]) == 1 and built[1] == built[0] and built[2] == built[0], built


@pytest.mark.parametrize("compiler", ["no-such-compiler-here", "false"])
def test_no_usable_compiler_leaves_one_warning(
    compiler: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Missing (not on PATH) or broken (``false`` exits 1): one warning line, once."""
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command on PATH")
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None
        assert native.load() is None  # once per process
    [record] = caplog.records
    assert "compiled kernels" in record.getMessage() and "\n" not in record.getMessage()


@pytest.mark.slow
@needs_compiler
def test_loading_the_library_keeps_subnormal_floats() -> None:
    """-ffast-math at link time would add crtfastmath, which turns on flush-to-zero for the
    whole process when the library loads; the kernels are compiled with it and linked
    without it."""
    assert native.load() is not None
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in float32
    assert float(tiny * 0.5) > 0.0


@pytest.mark.slow
@needs_compiler
def test_processes_building_at_once_share_one_library(tmp_path: Path) -> None:
    """Three processes with an empty cache load the kernels at the same moment (Ray workers
    starting together): each gets a working library, and the cache holds one (cpp_extension's
    lock makes the others wait for the first build)."""
    script = "from sat_model.model.kernels import native\nassert native.load() is not None\n"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    [folder] = (tmp_path / "sat" / "kernels").iterdir()  # one build for this CPU and source
    libraries = list(folder.glob("*.so"))
    assert len(libraries) == 1 and libraries[0].name.startswith("sat_kernels_"), libraries
