"""What a ``sat`` command reads from the project it runs in: params, the stage context, the
MLflow store and the registered model's name.

Commands that only read (``sat models``, ``sat caption``, ``sat serve``) run outside a project
too: without ``params.yaml`` the defaults and ``MLFLOW_TRACKING_URI`` apply. They never create
state there: an absent SQLite store is reported, not created empty (MLflow's client would).
MLflow is imported only where a command first needs it (:func:`use_mlflow`), after what can be
checked without it: a user error, or a caption with a model folder, never pays for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli.commands import CommandError
from pipeline.stages import StageContext, load_context, params_given, project_root

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from pipeline.settings import MlflowConfig, Params

__all__ = [
    "context",
    "model_name",
    "params_or_defaults",
    "registry_client",
    "store_uri",
    "tracking_uri",
    "use_mlflow",
]


def context(args: argparse.Namespace) -> StageContext:
    """The stage context of ``--params``/``-S``, as the DVC entry of every stage builds it."""
    return load_context(args.params, args.overrides)


def params_or_defaults(args: argparse.Namespace) -> Params:
    """``--params`` with ``-S``; outside a project (no ``params.yaml`` here, no ``--params``,
    no ``-S``) the defaults. A ``--params`` file that does not exist is an error: a mistyped
    profile path would otherwise run with the defaults. Read once per command: a command asks
    for the store, the model's name and its settings, and validating costs a second each time."""
    from pipeline.settings import Params, load_params

    loaded: Params | None = getattr(args, "_params", None)
    if loaded is None:
        if not Path(args.params).exists() and not args.overrides and not params_given(args):
            loaded = Params()
        else:
            loaded = load_params(args.params, args.overrides)
        args._params = loaded
    return loaded


def _mlflow(args: argparse.Namespace) -> MlflowConfig:
    return params_or_defaults(args).mlflow


def tracking_uri(args: argparse.Namespace) -> str:
    """The tracking store every stage of this project uses (``MLFLOW_TRACKING_URI`` first)."""
    from pipeline.tracking.store import resolve_tracking_uri

    return resolve_tracking_uri(_mlflow(args), project_root(args.params))


def store_uri(args: argparse.Namespace) -> str:
    """:func:`tracking_uri`, refused with the reason when it is a SQLite file that does not
    exist: nothing was registered there, and MLflow's client would create an empty store."""
    from pipeline.tracking.store import redact

    uri = tracking_uri(args)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise CommandError(
            f"no MLflow store at {redact(uri)}: nothing is registered there yet; run `make run` "
            "in the project (or pass --params path/to/params.yaml, or set MLFLOW_TRACKING_URI)"
        )
    return uri


def model_name(args: argparse.Namespace) -> str:
    """``--name``, else ``mlflow.model_name``."""
    return getattr(args, "name", None) or _mlflow(args).model_name


def use_mlflow(args: argparse.Namespace) -> None:
    """Called where a command first needs MLflow: from here on MLflow's logs, warnings and
    progress bars stay off the terminal, unless ``-v``."""
    if not args.verbose:
        from pipeline.tracking.quiet import quiet_mlflow

        quiet_mlflow()


def registry_client(args: argparse.Namespace) -> MlflowClient:
    """A client of the project's store (:func:`store_uri`, checked before MLflow is imported),
    MLflow kept quiet (:func:`use_mlflow`)."""
    uri = store_uri(args)
    use_mlflow(args)
    from mlflow import MlflowClient

    return MlflowClient(uri)
