"""A local tracking store that follows its project when the project is moved or copied.

MLflow records artifact locations as absolute ``file:`` URIs (an experiment's location, each
run's, each logged model's, each registered version's), and has no call to change them. A
project moved with ``mv`` would then look for its artifacts where they were (a champion that
``sat models`` lists but nothing can load), and a copy would quietly read the original's.

So when a command opens the project's own SQLite store (the file inside the project, its
artifacts in a folder of the project), :func:`follow_project` checks where the store's
experiments say their artifacts are. A location ``<old root>/<artifact folder>`` of a folder the
project was moved or copied from (:func:`_moved_from`) is rebased onto this project in one
transaction: every URI under the old artifact folder now names the same file under this one.
The rest is left as it is: a store or artifact folder outside the project (a shared one, a
tracking server, an ``s3://`` root) is never rewritten.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["URI_COLUMNS", "follow_project"]

# MLflow's columns holding an artifact location (a version's source may be a models:/ URI, left
# alone by the prefix match); a column a schema lacks is skipped
URI_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


def follow_project(db: Path, artifacts: Path, root: Path) -> list[str]:
    """Rebase the SQLite store ``db`` of the project at ``root`` whose artifacts folder is
    ``artifacts``, if the project was moved or copied since the store recorded them.

    Returns the old artifact folders (as URIs) that were rebased; nothing is done, and ``[]``
    returned, unless ``db`` and ``artifacts`` exist inside ``root``.
    """
    db, artifacts, root = db.resolve(), artifacts.resolve(), root.resolve()
    inside = db.is_relative_to(root) and artifacts.is_relative_to(root) and artifacts != root
    if not inside or not db.is_file() or not artifacts.is_dir():
        return []
    with closing(sqlite3.connect(db, timeout=30)) as con, con:  # one transaction, committed
        columns = _present(con)
        if ("experiments", "artifact_location") not in columns:
            return []  # a store MLflow has not initialised yet
        recorded = _recorded_roots(con, artifacts.relative_to(root).as_posix())
        old = [p for p in recorded if _moved_from(p, artifacts, db, root)]
        for prefix in old:
            for table, column in columns:
                _rebase(con, table, column, prefix, artifacts.as_uri())
    return old


def _present(con: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    found = []
    for table, column in URI_COLUMNS:
        if table in tables:
            names = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
            if column in names:
                found.append((table, column))
    return found


def _recorded_roots(con: sqlite3.Connection, folder: str) -> set[str]:
    """The artifact folders (``file:`` URIs ending in ``/<folder>``) the experiments name."""
    rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
    return {
        location
        for (location,) in rows
        if location and location.startswith("file://") and location.endswith(f"/{folder}")
    }


def _moved_from(prefix: str, artifacts: Path, db: Path, root: Path) -> bool:
    """Whether the artifact folder ``prefix`` that the store names is where this project was
    before: another project folder (neither holds the other), whose store there is gone (the
    project was moved; its artifacts went too) or another file (the project was copied).

    An old folder whose artifacts are there without its store is another project's, one that
    logged to this store through ``MLFLOW_TRACKING_URI``: left alone.
    """
    old_artifacts = Path(unquote(urlsplit(prefix).path))
    old_root = old_artifacts.parents[len(artifacts.relative_to(root).parts) - 1]
    if old_root.is_relative_to(root) or root.is_relative_to(old_root):
        return False
    old_db = old_root / db.relative_to(root)
    if old_db.exists():
        return not old_db.samefile(db)
    return not old_artifacts.exists()


def _rebase(con: sqlite3.Connection, table: str, column: str, old: str, new: str) -> None:
    """``old`` and every URI under ``old/`` in ``table.column`` made ``new`` and under ``new/``."""
    # table and column come from URI_COLUMNS, never from the data
    con.execute(
        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
        f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
        (new, len(old) + 1, old, len(old) + 1, f"{old}/"),
    )
