"""The ``sat`` command: one subcommand per user task.

Each subcommand is a thin handler that imports what it needs inside the function, so that
``sat --help`` stays fast and a handler's heavy dependencies (Ray, MLflow, torch) load only when
that handler runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _add_params_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", default="params.yaml", help="params file (default: %(default)s)"
    )
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param with dvc exp run's dotted syntax, e.g. -S train.soft.lr=2e-4",
    )


def _forward_params(args: argparse.Namespace) -> list[str]:
    out = ["--params", args.params]
    for item in args.overrides:
        out += ["-S", item]
    return out


# ----------------------------------------------------------------------------- summary
def _summary(args: argparse.Namespace) -> int:
    """Print the metrics table of the evaluated models and how to caption an image."""
    reports = Path(args.reports)
    rows = []
    for attention in ("soft", "hard"):
        path = reports / attention / "metrics.json"
        if path.exists():
            rows.append((attention, json.loads(path.read_text())))
    if not rows:
        print(f"no metrics under {reports}/{{soft,hard}}/metrics.json yet: run `dvc repro`")
        return 1
    keys = ["bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor", "rouge_l", "cider"]
    keys += [k for k in ("pointing_accuracy",) if any(k in m for _, m in rows)]
    print("model  " + "  ".join(f"{k:>8}" for k in keys))
    for attention, metrics in rows:
        cells = "  ".join(f"{metrics.get(k, float('nan')):8.4f}" for k in keys)
        print(f"{attention:<6} {cells}")
    registry = reports / "registry.json"
    if registry.exists():
        info = json.loads(registry.read_text())
        print(f"champion: {info.get('champion')}")
    print("caption an image:  .venv/bin/sat caption path/to/image.jpg --attention-out overlays/")
    return 0


# ------------------------------------------------------------------------------- train
def _train(args: argparse.Namespace) -> int:
    from pipeline.stages import train

    return train.main([*_forward_params(args), "--attention", args.attention]) or 0


# -------------------------------------------------------------------------------- tune
def _tune(args: argparse.Namespace) -> int:
    from pipeline.stages import tune

    extra = ["--address", args.address] if args.address else []
    return tune.main([*_forward_params(args), *extra]) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sat", description="Show, Attend and Tell: train, tune, evaluate, serve."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("summary", help="print the metrics table of the evaluated models")
    p.add_argument("--reports", default="reports")
    p.set_defaults(handler=_summary)

    p = sub.add_parser("train", help="train one model (soft or hard attention) through Ray Train")
    _add_params_args(p)
    p.add_argument("--attention", choices=["soft", "hard"], required=True)
    p.set_defaults(handler=_train)

    p = sub.add_parser("tune", help="Ray Tune sweep; each trial an MLflow child run")
    _add_params_args(p)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS)")
    p.set_defaults(handler=_tune)

    # evaluation, registry and captioning commands are added by _register_more below
    _register_more(sub)
    return parser


def _register_more(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Subcommands for evaluation, the registry and captioning (caption, models, promote...)."""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
