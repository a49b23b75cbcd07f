"""``sat models`` and ``sat promote``: the registered versions and the ``champion`` alias.

Both read the project's tracking store (:func:`pipeline.cli.project.store_uri`): one that does
not exist yet is reported, never created.
"""

from __future__ import annotations

import argparse

from pipeline.cli.commands import CommandError, add_command
from pipeline.cli.project import model_name, params_or_defaults, store_uri
from pipeline.stages import add_params_args

__all__ = ["add_parsers"]

NAME_HELP = "registered model (default: mlflow.model_name)"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``sat models`` and ``sat promote``."""
    p = add_command(
        sub,
        "models",
        summary="registered versions with metrics and aliases",
        description="Every registered version of the model: its attention variant, its "
        "headline scores (BLEU-4, METEOR, CIDEr and any registered metric's) and aliases (the "
        "champion is the one `sat caption` and `sat serve` use). "
        "Reads the tracking store of mlflow.tracking_uri (or MLFLOW_TRACKING_URI); creates "
        "nothing.",
        examples=["sat models", "sat models --params profiles/flickr8k/params.yaml"],
    )
    add_params_args(p)
    p.add_argument("--name", default=None, help=NAME_HELP)
    p.set_defaults(handler=_models, quiet=True)

    p = add_command(
        sub,
        "promote",
        summary="move the champion alias to the best (or named) version",
        description="Move the `champion` alias to the registered version with the best "
        "score (mlflow.champion_metric, or --metric), or to --version. The register stage "
        "does this after every run; this is for choosing by hand.",
        examples=["sat promote --metric cider", "sat promote --version 3"],
    )
    add_params_args(p)
    p.add_argument("--name", default=None, help=NAME_HELP)
    p.add_argument("--metric", default=None, help="metric to rank by (mlflow.champion_metric)")
    p.add_argument(
        "--version", default=None, help="the version to promote, whatever its score (the best)"
    )
    p.set_defaults(handler=_promote, quiet=True)


def _models(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    from pipeline.tracking.registry import list_versions
    from sat_model.evaluation.metrics import headline_keys, metric_label
    from sat_model.params import load_plugins

    load_plugins()  # metrics registered outside the repository

    name = model_name(args)
    rows = list_versions(MlflowClient(store_uri(args)), name)
    if not rows:
        raise CommandError(f"no registered version of {name!r}: run `make run` to register one")
    keys = headline_keys()  # the registered metrics' headline scores
    heads = " ".join(f"{metric_label(k):>7}" for k in keys)
    print(f"{'version':>7}  {'attention':<9} {heads}  aliases")
    for r in rows:
        cells = " ".join(f"{r.metrics.get(k, float('nan')):7.4f}" for k in keys)
        print(f"{r.version:>7}  {r.attention or '-':<9} {cells}  {','.join(r.aliases)}")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    from pipeline.tracking.registry import promote

    metric = args.metric or params_or_defaults(args).mlflow.champion_metric
    # a RegistryError (no such version, no metric) is a user error: main prints it
    out = promote(MlflowClient(store_uri(args)), model_name(args), metric, args.version)
    moved = "moved" if out.promoted else "stays"
    print(
        f"champion {moved}: {out.model_name} version {out.champion} "
        f"({metric} {out.candidate_value}); previously {out.previous_champion} ({out.reason})"
    )
    return 0
