"""One module per DVC stage; each is a thin ``main(argv=None)`` over a ``sat_model`` function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "OutputLocked",
    "add_params_args",
    "lock_path",
    "output_lock",
    "run_locked",
    "stage_parser",
]


class OutputLocked(RuntimeError):
    """Another process (a ``dvc repro`` stage, a ``sat`` command) is writing the same output."""


def add_params_args(parser: argparse.ArgumentParser) -> None:
    """``--params FILE`` and repeatable ``-S key.path=value`` (the syntax of ``dvc exp run -S``)."""
    parser.add_argument("--params", default="params.yaml", help="params file (%(default)s)")
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param with dvc exp run's dotted syntax, e.g. -S train.soft.lr=2e-4",
    )


def stage_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser every stage starts from: ``python -m <module>`` with params args."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    add_params_args(parser)
    return parser


def lock_path(output: Path) -> Path:
    """The lock file of an output folder: ``.<name>.lock`` beside it (outside DVC's hash)."""
    output = Path(output).resolve()
    return output.parent / f".{output.name}.lock"


@contextmanager
def output_lock(output: Path, stage: str) -> Iterator[None]:
    """Hold the write lock of ``output`` for ``stage``; fail at once if another writer holds it.

    Failing rather than waiting: a second writer that waited would overwrite the first one's
    result (a training of hours) with no one asking for it. The lock is an ``flock``: the kernel
    drops it when its holder dies, so a killed run never leaves the output locked.
    """
    from filelock import FileLock, Timeout

    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise OutputLocked(
            f"{output} is being written by another run (a dvc repro stage or a sat command "
            f"holds {path}); wait for it to finish, then run again"
        ) from None
    try:
        yield
    finally:
        lock.release()


def run_locked(stage: str, output: Callable[[], Path], run: Callable[[], int]) -> int:
    """``run()`` under the :func:`output_lock` of ``output()``; a held lock, an output path the
    params may not name or a folder that is not sat's is one line on stderr and exit status 1,
    never a traceback."""
    from sat_model.atomic import ForeignFolderError
    from sat_model.paths import PathError

    try:
        with output_lock(output(), stage):
            return run()
    except (OutputLocked, ForeignFolderError, PathError) as e:
        print(f"{stage}: error: {e}", file=sys.stderr)
        return 1
