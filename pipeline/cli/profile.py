"""``sat profile new``: a dataset profile (``profiles/<name>/``) for a user's own photos."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from pipeline.cli.commands import CommandError, add_command, one_line_usage_errors

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sat profile`` and its action ``new``."""
    p = add_command(
        sub,
        "profile",
        summary="dataset profiles (profiles/<name>/)",
        description="A dataset profile is a project of its own under profiles/<name>/ "
        "(params.yaml, dvc.yaml, its outputs) that `make run PROFILE=<name>` runs.",
        examples=["sat profile new mine --images photos/ --captions captions.csv"],
    )
    actions = p.add_subparsers(
        dest="action", required=True, metavar="ACTION", help="what to do with a profile"
    )
    new = actions.add_parser(
        "new",
        help="a profile for your own photos and a captions file (README, Your own data)",
        description=textwrap.fill(
            "Write profiles/<name>/params.yaml and dvc.yaml for a folder of photos and a "
            "captions file (CSV or JSON lines: file, caption, optional split).",
            79,
        ),
        epilog="examples:\n  sat profile new mine --images photos/ --captions captions.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    one_line_usage_errors(new, "sat profile")
    new.add_argument("name", help="the profile's folder name under profiles/")
    new.add_argument("--images", required=True, metavar="DIR", help="the folder of photos")
    new.add_argument(
        "--captions",
        required=True,
        metavar="FILE",
        help="CSV or JSON lines: file (relative to --images), caption, optional split",
    )
    new.set_defaults(handler=_new, command="profile")


def _new(args: argparse.Namespace) -> int:
    from pipeline.stages.profiles import ProfileError, new_profile

    root = Path.cwd().resolve()
    try:
        folder = new_profile(root, args.name, Path(args.images), Path(args.captions))
    except ProfileError as e:
        raise CommandError(str(e)) from None
    rel = folder.relative_to(root) if folder.is_relative_to(root) else folder
    print(f"wrote {rel}/params.yaml and {rel}/dvc.yaml; next:")
    print(f"  make run PROFILE={args.name}")
    print(f"  .venv/bin/sat caption --params {rel}/params.yaml path/to/photo.jpg")
    print(f"  .venv/bin/sat serve --params {rel}/params.yaml")
    return 0
