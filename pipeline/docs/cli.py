"""The `sat` command reference page, generated from its argparse parser at docs build time.

Each command's section is its own ``--help`` text, so the page follows every change to the
parser (``pipeline.cli.main.build_parser``) without an edit here.

    python -m pipeline.docs.cli   # print the page
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence

__all__ = ["cli_page", "commands"]

WIDTH = "100"  # columns of the help text, whatever terminal builds the site


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser, then every subcommand's parser, depth first, in the order they were added."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:  # an alias maps to the same parser
                    seen.add(id(sub))
                    yield from commands(sub)


def _build_parser() -> argparse.ArgumentParser:
    from pipeline.cli.main import build_parser

    return build_parser()


def cli_page(parser: argparse.ArgumentParser | None = None) -> str:
    """The markdown page: one section per command, its ``--help`` as printed."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse reads the width from here
    try:
        parser = parser or _build_parser()
        sections = [(p.prog, p.format_help().rstrip()) for p in commands(parser)]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    lines = [
        "# `sat` command reference",
        "",
        "Every command's `--help`, generated from the parser when the site is built. Every "
        "command reports a user error (bad params, a missing model or file) in one line, "
        "`sat <command>: error: …`, and exits 1; `sat -v …` shows the traceback.",
    ]
    for prog, text in sections:
        lines += ["", f"## `{prog}`", "", "```text", text, "```"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    print(cli_page(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
