"""Dataset profiles: ``profiles/<name>/`` runs the whole pipeline on one dataset.

A profile folder holds a ``params.yaml`` (every key of the root one, with the values chosen for
that dataset) and a ``dvc.yaml`` written from the root pipeline by this module. The folder is the
profile's project root: the stages run there (``--params params.yaml``), so its ``data/``,
``models/``, ``reports/``, ``mlflow.db`` and ``ray_results/`` sit beside the default pipeline's
instead of over them, and ``dvc repro profiles/<name>/dvc.yaml`` needs no other switch.

The profile's ``dvc.yaml`` is the root one with the library paths (``pipeline/``,
``sat_model/``) made relative to the profile folder, so a stage, dep or param added to the root
pipeline reaches every profile when this module runs again::

    python -m pipeline.profiles          # rewrite profiles/*/dvc.yaml
    python -m pipeline.profiles --check  # exit 1 if one is stale (make test runs the test)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["LIBRARY_DIRS", "PROFILES_DIR", "profile_dvc", "profile_dvc_text", "profiles"]

PROFILES_DIR = "profiles"
# top-level folders of the repository that stage deps name; data outputs stay profile-relative
LIBRARY_DIRS = ("pipeline", "sat_model")
_HEADER = """\
# Written by `python -m pipeline.profiles` from the root dvc.yaml: edit that one, then run it.
# The profile's stages run in this folder, with this folder's params.yaml; the library paths
# point back to the repository root (README, "Results on Flickr8k"). Its scores:
# `sat summary --reports profiles/<name>/reports`, or name the files to `dvc metrics show`.
"""


def _library_path(path: str, up: str) -> str:
    top = path.split("/", 1)[0]
    return f"{up}{path}" if top in LIBRARY_DIRS else path


def profile_dvc(root_dvc: dict[str, Any], depth: int = 2) -> dict[str, Any]:
    """The stages of the root ``dvc.yaml`` (parsed) as they read from a folder ``depth`` levels
    down. The top-level ``metrics`` and ``plots`` stay out: DVC collects them from every
    ``dvc.yaml`` of the repository, so a profile never run in a clone would make a bare
    ``dvc metrics show`` there warn about its missing files."""
    up = "../" * depth
    profile = {"stages": copy.deepcopy(root_dvc.get("stages", {}))}
    for stage in profile["stages"].values():
        stage["deps"] = [_library_path(dep, up) for dep in stage.get("deps", [])]
    return profile


def profile_dvc_text(project_root: Path) -> str:
    """The ``dvc.yaml`` text every profile of ``project_root`` should hold."""
    root_dvc = yaml.safe_load((project_root / "dvc.yaml").read_text(encoding="utf-8"))
    body = yaml.safe_dump(profile_dvc(root_dvc), sort_keys=False, width=100)
    return _HEADER + body


def profiles(project_root: Path) -> list[Path]:
    """Every profile folder: ``profiles/<name>/`` with a ``params.yaml``."""
    return sorted(p.parent for p in (project_root / PROFILES_DIR).glob("*/params.yaml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a dvc.yaml is stale")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    text = profile_dvc_text(args.root)
    stale = False
    for folder in profiles(args.root):
        path = folder / "dvc.yaml"
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        name = path.relative_to(args.root)
        if args.check:
            stale = True
            print(f"{name} is stale: run python -m pipeline.profiles")
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
