"""One module per DVC stage; each is a thin ``main(argv=None)`` over a ``sat_model`` function."""

from __future__ import annotations

import argparse

__all__ = ["add_params_args", "stage_parser"]


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
