"""One module per DVC stage, each of one shape.

``run(ctx, ...)`` does the stage's work from a :class:`StageContext` (validated params and the
project root: the folder of the params file, which is the working directory under DVC); the
``sat`` command calls it directly. ``main(argv=None)`` is the thin DVC entry: it parses
``--params``/``-S`` and the stage's own flags, builds the context and calls ``run``. The logic a
stage runs lives in ``sat_model`` and the pipeline modules. A stage ends with one line on stdout
(:func:`finished`): what it did, where its output is and how long it took.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.settings import Params

__all__ = [
    "DEFAULT_PARAMS",
    "OutputLocked",
    "StageContext",
    "add_params_args",
    "cli_context",
    "finished",
    "format_duration",
    "load_context",
    "lock_path",
    "output_lock",
    "params_given",
    "project_root",
    "run_locked",
    "stage_parser",
]


class OutputLocked(RuntimeError):
    """Another process (a ``dvc repro`` stage, a ``sat`` command) is writing the same output."""


class _DefaultParams(str):
    """``--params`` when not given: ``params.yaml``, told apart from the same name typed."""


DEFAULT_PARAMS = _DefaultParams("params.yaml")


def params_given(args: argparse.Namespace) -> bool:
    """Whether ``--params`` was named on the command line (then the file must exist)."""
    return args.params is not DEFAULT_PARAMS


def add_params_args(parser: argparse.ArgumentParser) -> None:
    """``--params FILE`` and repeatable ``-S key.path=value`` (the syntax of ``dvc exp run -S``)."""
    parser.add_argument("--params", default=DEFAULT_PARAMS, help="params file (%(default)s)")
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param with dvc exp run's dotted syntax, e.g. -S train.soft.lr=2e-4",
    )


def project_root(params_file: str | Path) -> Path:
    """The project root: the folder of the params file (the working directory under DVC, and
    for ``sat`` commands run outside a project, where ``params.yaml`` may not exist)."""
    return Path(params_file).resolve().parent


@dataclass(frozen=True)
class StageContext:
    """What every stage runs with: validated params, where they came from, the project root."""

    params: Params
    params_file: Path  # absolute
    overrides: tuple[str, ...] = ()  # the -S items the params were loaded with

    @property
    def root(self) -> Path:
        """The project root (:func:`project_root`)."""
        return project_root(self.params_file)

    def path(self, value: str | Path) -> Path:
        """A path from params as an absolute one, relative ones under :attr:`root`."""
        from sat_model.paths import absolute

        return absolute(value, self.root)


def load_context(params_file: str | Path, overrides: Sequence[str] = ()) -> StageContext:
    """Load and validate ``params_file`` with ``-S`` overrides (``ParamsError`` if invalid)."""
    from pipeline.settings import load_params

    params = load_params(params_file, list(overrides))
    return StageContext(params, Path(params_file).resolve(), tuple(overrides))


def cli_context(stage: str, args: argparse.Namespace) -> StageContext:
    """:func:`load_context` for a stage's ``main``: a bad params file or ``-S`` value is one line
    on stderr (``<stage>: error: ...``, every bad key named) and exit status 1, not a traceback."""
    from sat_model.config import ParamsError

    try:
        return load_context(args.params, args.overrides)
    except ParamsError as e:
        print(f"{stage}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


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


def format_duration(seconds: float) -> str:
    """``2m10s``, ``1h05m``, ``45s``: the ETA's resolution, not more."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def finished(stage: str, what: str, output: Path, root: Path, started: float) -> str:
    """Print and return the stage's one line: ``<stage>: <what> -> <output> (<duration>)``.

    ``output`` is shown relative to the project ``root`` when it lies inside it (the path a user
    types next), ``started`` is the ``time.perf_counter()`` at the stage's start.
    """
    output, root = Path(output).resolve(), Path(root).resolve()
    where = os.path.relpath(output, root) if output.is_relative_to(root) else str(output)
    line = f"{stage}: {what} -> {where} ({format_duration(time.perf_counter() - started)})"
    print(line, flush=True)
    return line
