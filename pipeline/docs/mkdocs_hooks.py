"""MkDocs hooks: the generated reference pages, written into the site at build time.

``mkdocs.yml`` names this file under ``hooks``; the pages exist only in the built site, so they
cannot go stale in git.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mkdocs.structure.files import File, Files

from pipeline.docs.cli import cli_page
from pipeline.docs.params import params_page

__all__ = ["GENERATED", "on_files"]

# page path in the site -> the function that writes it
GENERATED: dict[str, Callable[[], str]] = {
    "reference/params.md": params_page,
    "reference/cli.md": cli_page,
}


def on_files(files: Files, config: Any) -> Files:
    """Add each generated page to the site's files (before the navigation is built)."""
    for path, page in GENERATED.items():
        files.append(File.generated(config, path, content=page()))
    return files
