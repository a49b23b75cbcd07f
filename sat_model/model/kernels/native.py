"""The compiled kernels (``native_kernels.cpp``): built on first use, called through ctypes.

The first call compiles the source through ``torch.utils.cpp_extension`` with the machine's C++
compiler (``$CXX``, else ``c++``) for this CPU (``-march=native``) into
``$XDG_CACHE_HOME/sat/kernels`` (default ``~/.cache``), in a folder named by the CPU's features
and the source, so another machine builds its own; later processes, from any checkout of that
source, load the built library (ninja rebuilds it when the flags change). The matrix products
stay with torch's own BLAS, whose ``sgemm_`` the recurrences call by address. Where there is no
compiler or the build fails, ``load`` returns None and a warning says why, once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["NativeKernels", "cache_dir", "call", "load"]

SOURCE = Path(__file__).with_name("native_kernels.cpp")
# compiled with -ffast-math, so that the loops vectorise, and linked without it (see the source)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LINK_FLAGS = ("-fopenmp", "-lm")

_log = logging.getLogger(__name__)
# the C functions (``sat_<name>``): how many pointer arguments, then how many int64 ones
_SIGNATURES = {
    "soft_recurrence_forward": (17, 7),
    "soft_recurrence_backward": (26, 7),
    "hard_recurrence_forward": (23, 7),
    "hard_recurrence_backward": (33, 7),
}


class NativeKernels:
    """The loaded library's functions with their C signatures, and BLAS's ``sgemm_``."""

    soft_recurrence_forward: Callable[..., None]
    soft_recurrence_backward: Callable[..., None]
    hard_recurrence_forward: Callable[..., None]
    hard_recurrence_backward: Callable[..., None]

    def __init__(self, library: ctypes.CDLL, sgemm: int | None) -> None:
        self.sgemm = sgemm  # None where this torch build exports no sgemm_
        for name, (pointers, integers) in _SIGNATURES.items():
            function = getattr(library, f"sat_{name}")
            function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * integers
            function.restype = None
            setattr(self, name, function)


def call(function: Callable[..., None], tensors: list[Tensor | None], *sizes: int) -> None:
    """``function`` on the tensors' data (a null pointer for None), then the sizes and the
    thread count."""
    pointers = (None if t is None else t.data_ptr() for t in tensors)
    function(*pointers, *sizes, torch.get_num_threads())


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sat" / "kernels"


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built or taken from the cache; None (with one warning) where they cannot
    be had."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        _log.warning("no C++ compiler (CXX or c++) on PATH: the compiled kernels cannot be built")
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_build())), _sgemm())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _log.warning("the compiled kernels could not be built (%s)", first_line)
        return None


def _sgemm() -> int | None:
    """The address of BLAS's ``sgemm_`` in the MKL that torch links (``libtorch_cpu``)."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        function = ctypes.CDLL(str(library)).sgemm_
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def _build() -> Path:
    """The library for this source and CPU, built by ``torch.utils.cpp_extension.load``
    (ninja, rebuilt when the source or the flags change, a lock for processes that build at
    once) into a folder named by the CPU's features and the source: ``-march=native`` builds
    for this CPU."""
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its import logs where it looked for CUDA, which we never use
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    # named by the CPU and the source: checkouts of other versions keep builds of their own
    source = SOURCE.read_text(encoding="utf-8")
    name = "sat_kernels_" + hashlib.sha256((_cpu_features() + source).encode()).hexdigest()[:16]
    directory = cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # its compiler checks warn on their own; one warning here
        warnings.simplefilter("ignore")
        path = cpp_extension.load(
            name=name,
            sources=[str(_source_in(directory, source))],
            extra_cflags=list(COMPILE_FLAGS),
            extra_ldflags=list(LINK_FLAGS),
            build_directory=str(directory),
            is_python_module=False,
        )
    return Path(str(path))


def _source_in(directory: Path, source: str) -> Path:
    """The source's copy in its build folder, written once: ninja's build file names the
    source's path, so building from each checkout's own file would rebuild the shared library
    whenever another checkout (a project copy, a worktree) had built it last."""
    copy = directory / SOURCE.name
    if not copy.is_file():
        partial = directory / f".{SOURCE.name}.{os.getpid()}"
        partial.write_text(source, encoding="utf-8")
        try:
            os.link(partial, copy)  # never over a copy another process wrote: same text, mtime
        except FileExistsError:
            pass
        finally:
            partial.unlink()
    return copy


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))
