"""``sat models``, ``sat promote``, ``sat card`` and ``sat review``: the registered versions,
the ``champion`` alias, each version's model card, and a candidate compared with the champion.

Both read the project's tracking store (:func:`pipeline.cli.project.store_uri`): one that does
not exist yet is reported, never created.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.commands import CommandError, add_command
from pipeline.cli.project import model_name, params_or_defaults, registry_client
from pipeline.stages import add_params_args

__all__ = ["add_parsers"]

NAME_HELP = "registered model (default: mlflow.model_name)"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``sat models``, ``sat promote``, ``sat card`` and ``sat review``."""
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
    p.set_defaults(handler=_models)

    p = add_command(
        sub,
        "promote",
        summary="move the champion alias to the best (or named) version",
        description="Move the `champion` alias to the registered version with the best "
        "score (mlflow.champion_metric, or --metric) among those at or above the promotion "
        "floor (promotion.floor), or to --version. The register stage does this after every "
        "run; this is for choosing by hand. A version below the floor is promoted only with "
        "--override-floor and a --reason, both recorded on the version.",
        examples=[
            "sat promote --metric cider",
            "sat promote --version 3",
            'sat promote --version 3 --override-floor --reason "new test split, floor too high"',
        ],
    )
    add_params_args(p)
    p.add_argument("--name", default=None, help=NAME_HELP)
    p.add_argument("--metric", default=None, help="metric to rank by (mlflow.champion_metric)")
    p.add_argument(
        "--version", default=None, help="the version to promote, whatever its score (the best)"
    )
    p.add_argument(
        "--override-floor",
        action="store_true",
        help="with --version and --reason: promote it even below promotion.floor",
    )
    p.add_argument("--reason", default=None, help="why the floor is overridden (recorded)")
    p.set_defaults(handler=_promote)
    _add_card(sub)


def _add_card(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "card",
        summary="print the model card of a registered version",
        description="The model card the register stage generated for a version: its data "
        "(source, split sizes, DVC hashes), scores on the test split with scorer, beam and "
        "seed, training, params, intended use and limits; then what the registry says of it "
        "now (aliases, a floor override).",
        examples=["sat card", "sat card --version 2", "sat card --alias champion"],
    )
    add_params_args(p)
    p.add_argument("--name", default=None, help=NAME_HELP)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", default=None, help="the version (default: --alias)")
    which.add_argument("--alias", default="champion", help="the alias (%(default)s)")
    p.set_defaults(handler=_card)
    _add_review(sub)


def _add_review(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "review",
        summary="compare a registered version with the champion (Markdown and HTML)",
        description="Write review.md and review.html into --out: the candidate version (or "
        "the best one a DVC experiment or a commit registered) beside "
        "the champion (or --against), their test scores with the deltas, the seeds' spread "
        "where several seeds ran, the captions and attention figures of the first --photos "
        "test photos from both, and the params that differ. What a CI job posts on a pull "
        "request.",
        examples=[
            "sat review 3 --out review/",
            "sat review 3 --against 1 --out review/ --photos 6",
            "sat review exp:lr-try --out review/  # what `dvc exp run` registered",
        ],
    )
    add_params_args(p)
    p.add_argument(
        "candidate",
        help="a version number, an alias, exp:NAME or commit:SHA (the best version that DVC "
        "experiment or commit registered)",
    )
    p.add_argument("--against", default="champion", help="version or alias (%(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the report is written")
    p.add_argument("--photos", type=int, default=4, help="test photos captioned (%(default)s)")
    p.add_argument("--name", default=None, help=NAME_HELP)
    p.set_defaults(handler=_review)


def _models(args: argparse.Namespace) -> int:
    from sat_model.evaluation.metrics import headline_keys, metric_label
    from sat_model.params import load_plugins

    load_plugins()  # metrics registered outside the repository

    name = model_name(args)
    client = registry_client(args)
    from pipeline.tracking.registry import list_versions

    rows = list_versions(client, name)
    if not rows:
        raise CommandError(f"no registered version of {name!r}: run `make run` to register one")
    keys = headline_keys()  # the registered metrics' headline scores
    heads = " ".join(f"{metric_label(k):>7}" for k in keys)
    print(f"{'version':>7}  {'attention':<9} {heads}  aliases")
    for r in rows:
        cells = " ".join(f"{r.metrics.get(k, float('nan')):7.4f}" for k in keys)
        note = f"  (floor overridden: {r.floor_override})" if r.floor_override else ""
        print(f"{r.version:>7}  {r.attention or '-':<9} {cells}  {','.join(r.aliases)}{note}")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from pipeline.tracking.governance.floor import check_floor

    params = params_or_defaults(args)
    metric = args.metric or params.mlflow.champion_metric
    check_floor(params.promotion.floor)  # a ParamsError naming the key: main prints it
    if args.override_floor and not (args.version and args.reason):
        raise CommandError("--override-floor needs --version and --reason (both are recorded)")
    client = registry_client(args)
    from pipeline.tracking.registry import promote

    # a RegistryError (no such version, no metric, below the floor) is a user error
    out = promote(
        client,
        model_name(args),
        metric,
        args.version,
        floor=params.promotion.floor,
        override_reason=args.reason if args.override_floor else None,
    )
    moved = "moved" if out.promoted else "stays"
    print(
        f"champion {moved}: {out.model_name} version {out.champion} "
        f"({metric} {out.candidate_value}); previously {out.previous_champion} ({out.reason})"
    )
    return 0


def _card(args: argparse.Namespace) -> int:
    name = model_name(args)
    client = registry_client(args)
    from pipeline.tracking.governance.card import card_text

    # a RegistryError (no such version or alias, no card) is a user error: main prints it
    print(card_text(client, name, args.version, args.alias), end="")
    return 0


def _review(args: argparse.Namespace) -> int:
    from pipeline.cli.project import context

    if args.photos < 1:
        raise CommandError(f"--photos must be at least 1, got {args.photos}")
    ctx = context(args)
    from pipeline.tracking.governance.review import review_photos, write_review

    photos = review_photos(ctx.params, ctx.root, args.photos)
    if not photos:
        raise CommandError("no test photos in the project's prepared data: run `make run` first")
    client = registry_client(args)
    sides = (args.candidate, args.against)
    metric = ctx.params.mlflow.champion_metric  # picks among an experiment's versions
    md, page = write_review(client, model_name(args), sides, photos, Path(args.out), metric)
    print(f"review written: {md} and {page}")
    return 0
