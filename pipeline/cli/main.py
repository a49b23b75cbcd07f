"""The ``sat`` command: one subcommand per user task.

Each subcommand is a thin handler that imports what it needs inside the function, so that
``sat --help`` stays fast and a handler's heavy dependencies (Ray, MLflow, torch) load only when
that handler runs, after what it can check without them (its arguments, that the paths it is
given and a local tracking store exist): a user error is told before any of them loads. The
commands live by group: :mod:`~pipeline.cli.summary`, :mod:`~pipeline.cli.stage_commands`
(train, tune, evaluate), :mod:`~pipeline.cli.registry` (models, promote),
:mod:`~pipeline.cli.profile`, ``sat serve`` in :mod:`pipeline.serving.command`, ``sat caption``
in :mod:`~pipeline.cli.caption`.

Every command keeps one convention (:mod:`~pipeline.cli.commands`): ``sat <command> --help``
says what it does with examples, and a user error (bad params, a missing model or file, an
unusable input, a tracking store that does not answer) ends with one line ``sat <command>:
error: ...`` on stderr and exit status 1, the first cause first; ``-v`` shows the traceback
instead, and MLflow's warnings and download progress bars, which ``sat`` otherwise keeps quiet
from where a command first needs MLflow (:func:`pipeline.cli.project.use_mlflow`). Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pipeline.cli import caption, profile, registry, stage_commands, summary
from pipeline.cli.commands import CommandError, one_line_usage_errors
from pipeline.serving import command as serve
from pipeline.stages.user_errors import is_user_error, one_line

__all__ = ["CommandError", "build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=default,
        help="show tracebacks; caption, models, promote: MLflow's logs and progress bars too",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sat",
        description="Show, Attend and Tell: train, tune, evaluate, serve. "
        "`sat <command> --help` says what each command does, with examples.",
    )
    one_line_usage_errors(parser, "sat")
    parser.add_argument("--version", action="version", version=f"sat {_version()}")
    _add_verbose(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    summary.add_parser(sub)
    stage_commands.add_parsers(sub)
    caption.add_parser(sub)
    registry.add_parsers(sub)
    profile.add_parser(sub)
    serve.add_parser(sub)
    # `sat caption -v ...` as well as `sat -v caption ...`; SUPPRESS keeps a -v given before
    # the command when the subcommand's own is absent
    for command in sub.choices.values():
        if "-v" not in command._option_string_actions:
            _add_verbose(command, argparse.SUPPRESS)
    return parser


def _is_user_error(err: BaseException) -> bool:
    return isinstance(err, CommandError) or is_user_error(err)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"sat {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose or not _is_user_error(e):
            raise
        print(f"sat {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
