"""Keep MLflow's chatter off a user's terminal: its INFO/WARNING logs, Python warnings and
artifact progress bars (``sat`` commands unless ``-v``, and the ``register`` stage, whose
``log_model`` calls would otherwise print them for every version)."""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_mlflow"]


def quiet_mlflow() -> None:
    """Silence MLflow for the rest of this process; errors still reach the caller."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")
    for name in ("mlflow", "alembic"):  # alembic: MLflow's SQLite schema migrations
        logging.getLogger(name).setLevel(logging.ERROR)
    from mlflow.utils import logging_utils

    # the stream behind MLflow's own prints (`Successfully registered model ...`, `Created
    # version ...`), which no logger level reaches. Its switch (`disable_logging`) is not
    # enough: MLflow turns it back on when a `log_model` call leaves its internal guard, so
    # the stream's write is replaced for the rest of the process instead
    logging_utils.MLFLOW_LOGGING_STREAM.write = _write_nothing  # type: ignore[method-assign]
    warnings.simplefilter("ignore")
    # MLflow re-enables its UserWarnings inside some calls (`filter_user_warnings_once`), past
    # any filter: drop them where they would be shown
    warnings.showwarning = _drop_warning


def _drop_warning(*args: object, **kwargs: object) -> None:
    """A ``warnings.showwarning`` that shows nothing."""


def _write_nothing(text: str) -> None:
    """A stream ``write`` that writes nothing."""
