"""How a ``sat`` subcommand is declared and how it fails: the one convention every command keeps.

- ``sat <command> --help`` starts with what the command does and ends with examples
  (:func:`add_command`).
- A user error is one line ``sat <command>: error: ...`` on stderr and exit status 1: the
  handler raises :class:`CommandError` (or one of :mod:`pipeline.stages.user_errors`), and
  argparse's own complaints (a missing argument, a bad choice) are printed the same way
  (:func:`one_line_usage_errors`) instead of argparse's usage block and status 2.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["CommandError", "add_command", "one_line_usage_errors"]


class CommandError(Exception):
    """A user error found by a ``sat`` command; its message is the line ``sat`` prints."""


def one_line_usage_errors(parser: argparse.ArgumentParser, prog: str) -> None:
    """argparse's own errors as every other error of ``prog``: one line on stderr, status 1."""

    def error(message: str) -> NoReturn:
        print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(1)

    parser.error = error  # type: ignore[method-assign]


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    summary: str,
    description: str,
    examples: Sequence[str],
) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` in ``sat --help``'s list, ``description`` and ``examples``
    (command lines, each with an optional ``  # why`` comment) in ``sat <name> --help``."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=textwrap.fill(description, 79),  # raw below: the examples keep their lines
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    one_line_usage_errors(parser, parser.prog)
    return parser
