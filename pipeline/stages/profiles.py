"""Dataset profiles: ``profiles/<name>/`` runs the whole pipeline on one dataset.

A profile folder holds a ``params.yaml`` (every key of the root one, with the values chosen for
that dataset) and a ``dvc.yaml`` written from the root pipeline by this module. The folder is the
profile's project root: the stages run there (``--params params.yaml``), so its ``data/``,
``models/``, ``reports/``, ``mlflow.db`` and ``ray_results/`` sit beside the default pipeline's
instead of over them, and ``dvc repro profiles/<name>/dvc.yaml`` needs no other switch.

The profile's ``dvc.yaml`` is the root one with the library paths (``pipeline/``,
``sat_model/``) made relative to the profile folder, so a stage, dep or param added to the root
pipeline reaches every profile when this module runs again::

    python -m pipeline.stages.profiles          # rewrite profiles/*/dvc.yaml
    python -m pipeline.stages.profiles --check  # exit 1 if one is stale (make test runs the test)

:func:`new_profile` (``sat profile new NAME --images DIR --captions FILE``) writes a profile for
your own photos: the Flickr8k profile's params (real photographs, chosen on Flickr8k's dev
split) with the ``folder`` source, its split sizes and the model name set.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "LIBRARY_DIRS",
    "PROFILES_DIR",
    "ProfileError",
    "new_profile",
    "profile_dvc",
    "profile_dvc_text",
    "profiles",
    "set_values",
]

PROFILES_DIR = "profiles"
# top-level folders of the repository that stage deps name; data outputs stay profile-relative
LIBRARY_DIRS = ("pipeline", "sat_model")
_HEADER = """\
# Written by `python -m pipeline.stages.profiles` from the root dvc.yaml: edit that, then run it.
# The profile's stages run in this folder, with this folder's params.yaml; the library paths
# point back to the repository root (docs/guide/datasets.md). Its scores:
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


class ProfileError(ValueError):
    """A profile cannot be written as asked (a bad name, a missing folder or file)."""


# the profile `sat profile new` starts from: real photographs, every key present
TEMPLATE = "flickr8k"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[\w-]+):(?P<rest>.*)$")


def set_values(text: str, values: dict[str, Any], note: str) -> str:
    """``text`` (a params file in DVC's block form) with the dotted keys of ``values`` set, each
    changed line's comment replaced by ``note``; the other lines and their comments stay as
    written. Values are written as ``dvc exp run -S`` writes them back (a list one item a line,
    None an empty value), so a later experiment on the profile changes only its own line."""
    out: list[str] = []
    path: list[tuple[int, str]] = []  # (indent, key) of the sections the line sits in
    done: set[str] = set()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        m = _KEY_LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            out.append(line)
            continue
        indent = len(m["indent"])
        path = [(n, k) for n, k in path if n < indent] + [(indent, m["key"])]
        dotted = ".".join(k for _, k in path)
        if dotted not in values:
            out.append(line)
            continue
        out.extend(_block_value(m["indent"], m["key"], values[dotted], note))
        done.add(dotted)
        while i < len(lines) and lines[i].startswith(f"{m['indent']}- "):  # the old list's items
            i += 1
    missing = sorted(set(values) - done)
    if missing:
        raise ProfileError(f"the template has no key {', '.join(missing)}")
    return "\n".join(out) + "\n"


def _block_value(indent: str, key: str, value: Any, note: str) -> list[str]:
    """The lines of ``key: value  # note`` in DVC's block form."""

    def scalar(v: Any) -> str:
        return yaml.safe_dump(v, width=1000).strip().removesuffix("...").strip()

    if value is None:
        return [f"{indent}{key}:  # {note}"]
    if isinstance(value, list):
        return [f"{indent}{key}:  # {note}", *(f"{indent}- {scalar(v)}" for v in value)]
    return [f"{indent}{key}: {scalar(value)}  # {note}"]


def _folder_size(images: Path, captions: Path) -> int:
    """How many images the captions file names, by the folder source's own reader (so a file
    it cannot read fails here with the error prepare would give)."""
    from sat_model.data.sources import SourceError
    from sat_model.data.sources.folder import FolderConfig, read_folder

    captions_file = os.path.relpath(captions, images)
    settings = FolderConfig(captions_file=captions_file, val_images=0, test_images=0)
    try:
        src = read_folder(images, settings)
    except SourceError as e:
        raise ProfileError(str(e)) from None
    return len(src.images)


def _minutes(n_images: int) -> int:
    # the Flickr8k profile's whole `make run` on a 2-core CPU, scaled by photos (docs/results.md)
    return max(1, round(n_images * 105.3 / 7000))


def _held_out(n_images: int) -> int:
    # a tenth each for val and test, at least one and at most Flickr's 1,000 (paper)
    return max(1, min(1000, n_images // 10))


def new_profile(project_root: Path, name: str, images: Path, captions: Path) -> Path:
    """Write ``profiles/<name>/`` (params.yaml and dvc.yaml) for a folder of photos and its
    captions file; return the folder. Paths are written relative to it when they can be."""
    if not _NAME.fullmatch(name):
        raise ProfileError(
            f"profile name {name!r}: use lower-case letters, digits, '-' and '_' (at most 64)"
        )
    if not (project_root / "dvc.yaml").is_file():
        raise ProfileError(f"{project_root} has no dvc.yaml: run this in the project's root folder")
    folder = project_root / PROFILES_DIR / name
    if folder.exists():
        raise ProfileError(f"profile {name!r} exists already ({folder}): pick another name")
    for flag, path in (("--images", images), ("--captions", captions)):
        if any(ord(c) < 32 or c == "\x7f" for c in str(path)):  # it would break params.yaml
            raise ProfileError(f"{flag} {str(path)!r}: a newline or control character in a path")
    images, captions = images.expanduser().resolve(), captions.expanduser().resolve()
    if not images.is_dir():
        raise ProfileError(f"--images {images} is not a folder")
    if not captions.is_file():
        raise ProfileError(f"--captions {captions} is not a file")
    n_images = _folder_size(images, captions)
    if n_images < 3:
        raise ProfileError(
            f"--captions {captions} names {n_images} image(s): train, val and test need at least 3"
        )
    held_out = _held_out(n_images)
    values = {
        "data.source": "folder",
        "data.root": _relative(images, folder, project_root.resolve().parent),
        "data.required_splits": ["train", "val", "test"],
        "data.folder.images_dir": ".",
        "data.folder.captions_file": _relative(captions, images, images.parent),
        "data.folder.val_images": held_out,
        "data.folder.test_images": held_out,
        "data.vocab.min_count": 2,
        "eval.split": "test",
        "mlflow.model_name": f"sat-captioner-{name}",
    }
    template = (project_root / PROFILES_DIR / TEMPLATE / "params.yaml").read_text(encoding="utf-8")
    body = template[template.index("\ndata:") + 1 :]
    header = (
        f"# Profile {name!r}, written by `sat profile new`: your photos in {images}, captions\n"
        f"# from {captions} ({n_images} images). Run: make run PROFILE={name}; then\n"
        f"# sat caption --params profiles/{name}/params.yaml photo.jpg. The other values are the\n"
        "# Flickr8k profile's (real photographs, chosen on its dev split; docs/decisions/).\n"
        "# Expected time of `make run` on 2 CPU cores, scaled from that profile's measured run\n"
        f"# (docs/results.md): ~{_minutes(n_images)} minutes.\n\n"
    )
    text = header + set_values(body, values, f"sat profile new ({n_images} images)")
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(text, encoding="utf-8")
    (folder / "dvc.yaml").write_text(profile_dvc_text(project_root), encoding="utf-8")
    return folder


def _relative(path: Path, start: Path, within: Path) -> str:
    """``path`` relative to ``start`` when both lie in ``within`` (the project's parent folder,
    as ../shared/data does: the pair moves together), else absolute (a home folder's photos)."""
    if not (path.is_relative_to(within) and start.resolve().is_relative_to(within)):
        return str(path)
    return Path(os.path.relpath(path, start.resolve())).as_posix()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a dvc.yaml is stale")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
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
            print(f"{name} is stale: run python -m pipeline.stages.profiles")
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
