"""Where files may be read from and written to: roots come from params, never from data files.

A data file (``images.parquet``) lists image names; the folder they are read from is the one
the params name (:func:`sat_model.data.sources.image_root`), so editing a table cannot widen
what is read.
Output folders named by params resolve against the project root; a relative path may not climb
out of it (``../elsewhere``), an absolute one (or ``~/...``) is the user's explicit choice.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "SHARED_DATA_ENV",
    "PathError",
    "absolute",
    "output_path",
    "resolve_inside",
    "shared_data",
]

# where the project's own copy of Flickr8k lives, for its tests and benchmarks
SHARED_DATA_ENV = "SAT_SHARED_DATA"


class PathError(ValueError):
    """A path from params points somewhere the project does not write."""


def resolve_inside(root: Path, name: str) -> tuple[Path, str]:
    """``(path, reason)``: ``root / name`` resolved, and why it may not be opened ("" if it may).

    ``"../x"``, an absolute name and a symbolic link out of ``root`` all resolve outside it.
    """
    root = Path(root).resolve()
    path = (root / name).resolve()
    if path.is_relative_to(root):
        return path, ""
    return path, f"path {name!r} escapes the image root {root}"


def absolute(value: str | Path, project_root: Path) -> Path:
    """``value`` as an absolute path: ``~`` expanded, a relative one under ``project_root``."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (Path(project_root) / path).resolve()


def output_path(value: str, project_root: Path) -> Path:
    """The absolute folder an output param names; a relative one must stay under the project.

    Raises:
        PathError: a relative path that resolves outside ``project_root``.
    """
    root = Path(project_root).resolve()
    given = Path(value).expanduser()
    if given.is_absolute():
        return given.resolve()
    path = (root / given).resolve()
    if not path.is_relative_to(root):
        raise PathError(
            f"output path {value!r} leaves the project root {root}; "
            f"name an absolute path to write outside the project"
        )
    return path


def shared_data(name: str = "") -> Path:
    """The project's own copy of Flickr8k (``name`` inside it: ``flickr8k-sample``,
    ``flickr8k-trainval``): ``$SAT_SHARED_DATA`` when set, else ``../shared/data`` beside the
    repository. Tests and benchmarks skip what is absent; a tested profile reads it linked in
    as ``datasets/<name>``, where a user's profiles find their datasets."""
    env = os.environ.get(SHARED_DATA_ENV)
    base = Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "shared/data"
    return base / name if name else base
