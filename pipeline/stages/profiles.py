"""Dataset profiles: ``profiles/<name>/`` runs the whole pipeline on one dataset.

A profile folder holds a ``params.yaml`` that holds only what differs from the root one (its
``extends: ../../params.yaml``; :func:`sat_model.params.read_params_file` merges the two) and a
``dvc.yaml`` written from the root pipeline by this module. The folder is the profile's project
root: the stages run there (``--params params.yaml``), so its ``data/``, ``models/``,
``reports/``, ``mlflow.db`` and ``ray_results/`` sit beside the default pipeline's instead of over
them, and ``dvc repro profiles/<name>/dvc.yaml`` needs no other switch.

The profile's ``dvc.yaml`` is the root one with the library paths (``pipeline/``,
``sat_model/``) made relative to the profile folder, and each stage's params split between the
two files: DVC reads params files as they are, not merged, so a key is tracked in the file that
sets it for the profile. A stage, dep or param added to the root pipeline, or a key added to
either params file, reaches the profile when this module runs again::

    python -m pipeline.stages.profiles          # rewrite profiles/*/dvc.yaml
    python -m pipeline.stages.profiles --check  # exit 1 if one is stale (make test runs the test)

:func:`new_profile` (``sat profile new NAME --images DIR --captions FILE``) writes a profile for
your own photos: the Flickr8k profile's values (real photographs, chosen on Flickr8k's dev
split) with the ``folder`` source, its split sizes and the model name set.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sat_model.params import EXTENDS, read_yaml

__all__ = [
    "LIBRARY_DIRS",
    "PROFILES_DIR",
    "Layers",
    "ProfileError",
    "new_profile",
    "overlay_text",
    "profile_dvc",
    "profile_dvc_text",
    "profiles",
    "read_layers",
]

PROFILES_DIR = "profiles"
# top-level folders of the repository that stage deps name; data outputs stay profile-relative
LIBRARY_DIRS = ("pipeline", "sat_model")
_HEADER = """\
# Written by `python -m pipeline.stages.profiles` from the root dvc.yaml and the two params
# files: edit those, then run it. The profile's stages run in this folder, with this folder's
# params.yaml over the root's; each param is tracked in the file that sets it, and the library
# paths point back to the repository root (docs/guide/datasets.md). Its scores:
# `sat summary --reports profiles/<name>/reports`, or name the files to `dvc metrics show`.
"""


def _library_path(path: str, up: str) -> str:
    top = path.split("/", 1)[0]
    return f"{up}{path}" if top in LIBRARY_DIRS else path


class ProfileError(ValueError):
    """A profile cannot be written as asked (a bad name, a missing folder or file)."""


_UNSET = object()  # a key a params tree does not hold (a YAML null is a value)


@dataclass(frozen=True)
class Layers:
    """A profile's params as DVC reads them: the keys its own file sets, and the file it
    ``extends`` (as the profile names it, and that file's keys). ``base_file`` None: the
    profile's file holds every key itself."""

    own: dict[str, Any]
    base_file: str | None = None
    base: dict[str, Any] = field(default_factory=dict)


def read_layers(folder: Path) -> Layers:
    """The params layers of the profile in ``folder``."""
    own = read_yaml((folder / "params.yaml").read_text(encoding="utf-8")) or {}
    base_file = own.pop(EXTENDS, None)
    if base_file is None:
        return Layers(own)
    try:
        base = read_yaml((folder / base_file).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ProfileError(f"{folder.name}: {EXTENDS} names {base_file}, not found") from None
    if EXTENDS in base:
        raise ProfileError(f"{folder.name}: {base_file} extends another file; DVC reads only two")
    return Layers(own, base_file, base)


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _UNSET
        tree = tree[part]
    return tree


def _inherited(key: str, base: Any, own: Any) -> list[str]:
    """The keys at or under ``key`` whose value the profile takes from the base file: those
    its own file does not set (a section it sets in part names the rest one by one)."""
    if own is _UNSET:
        return [key]
    if not (isinstance(base, dict) and isinstance(own, dict)):
        return []
    return [
        k
        for child in base
        for k in _inherited(f"{key}.{child}", base[child], own.get(child, _UNSET))
    ]


def _instances(key: str, matrix: dict[str, list[Any]]) -> list[str]:
    """``key`` as each item of a matrix stage reads it (``train.${item.attention}``)."""
    keys = [key]
    for name, values in matrix.items():
        keys = [k.replace(f"${{item.{name}}}", str(v)) for k in keys for v in values]
    return sorted(set(keys))


def _stage_params(name: str, stage: dict[str, Any], layers: Layers) -> list[Any]:
    """A stage's params split between the profile's file and the one it extends, so that a
    change to either re-runs the stage when it changes a value the stage reads, and a base value
    the profile overrides re-runs nothing. Except: a key a matrix stage reads per item
    (``train.${item.attention}``) is tracked whole in the base file, as DVC gives every item
    one list."""
    own: list[str] = []
    base: list[str] = []
    for key in stage["params"]:
        if not isinstance(key, str):
            raise ProfileError(f"stage {name}: a params file of its own ({key}) is not supported")
        keys = _instances(key, stage.get("matrix", {}))
        held = [k for k in keys if _get(layers.own, k) is not _UNSET]
        if held and len(held) < len(keys):
            unset = sorted(set(keys) - set(held))
            raise ProfileError(
                f"stage {name} reads {key}: the profile sets {held} but not {unset}; give "
                f"{', '.join(unset)} an empty section ({{}}) in its params.yaml"
            )
        own += [key] if held else []
        if len(keys) > 1 or keys[0] != key:
            base.append(key)
        else:
            base += _inherited(key, _get(layers.base, key), _get(layers.own, key))
    return [*own, {layers.base_file: base}] if base else own


def profile_dvc(
    root_dvc: dict[str, Any], layers: Layers | None = None, depth: int = 2
) -> dict[str, Any]:
    """The stages of the root ``dvc.yaml`` (parsed) as they read from a folder ``depth`` levels
    down, each stage's params split between the profile's ``layers``. The top-level ``metrics``
    and ``plots`` stay out: DVC collects them from every ``dvc.yaml`` of the repository, so a
    profile never run in a clone would make a bare ``dvc metrics show`` there warn about its
    missing files."""
    up = "../" * depth
    profile = {"stages": copy.deepcopy(root_dvc.get("stages", {}))}
    for name, stage in profile["stages"].items():
        stage["deps"] = [_library_path(dep, up) for dep in stage.get("deps", [])]
        if "params" in stage and layers is not None and layers.base_file is not None:
            stage["params"] = _stage_params(name, stage, layers)
    return profile


def profile_dvc_text(project_root: Path, folder: Path) -> str:
    """The ``dvc.yaml`` text the profile in ``folder`` should hold, from the root one and the
    profile's params."""
    root_dvc = yaml.safe_load((project_root / "dvc.yaml").read_text(encoding="utf-8"))
    body = yaml.safe_dump(profile_dvc(root_dvc, read_layers(folder)), sort_keys=False, width=100)
    return _HEADER + body


def profiles(project_root: Path) -> list[Path]:
    """Every profile folder: ``profiles/<name>/`` with a ``params.yaml``."""
    return sorted(p.parent for p in (project_root / PROFILES_DIR).glob("*/params.yaml"))


# the profile `sat profile new` starts from: real photographs
TEMPLATE = "flickr8k"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def overlay_text(template: str, values: dict[str, Any], base: dict[str, Any], note: str) -> str:
    """``template`` (a profile's params file) with the dotted keys of ``values`` set, each with
    ``note`` as its comment, less every key whose value is then ``base``'s: an overlay holds
    only what differs. Written by DVC's own YAML writer (ruamel.yaml's round trip), as
    ``dvc exp run -S`` writes it back, so the template's other lines keep their comments and a
    later experiment on the profile changes only its own line."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    writer = YAML()
    writer.default_flow_style = False
    tree = writer.load(template)
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, CommentedMap())
        node[leaf] = value
        node.ca.items.pop(leaf, None)  # the template's reason for its own value
        node.yaml_add_eol_comment(note, leaf)
    _drop_inherited(tree, base)
    out = io.StringIO()
    writer.dump(tree, out)
    return out.getvalue()


def _drop_inherited(node: dict[str, Any], base: Any) -> None:
    """Delete from ``node`` every key whose value is ``base``'s, and sections left empty."""
    for key in list(node):
        value, inherited = node[key], base.get(key, _UNSET) if isinstance(base, dict) else _UNSET
        if isinstance(value, dict) and isinstance(inherited, dict):
            _drop_inherited(value, inherited)
            if not value:
                del node[key]
        elif value == inherited:
            del node[key]


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
    template_dir = project_root / PROFILES_DIR / TEMPLATE
    body = overlay_text(
        (template_dir / "params.yaml").read_text(encoding="utf-8"),
        values,
        read_layers(template_dir).base,
        f"sat profile new ({n_images} images)",
    )
    body = body[body.index(f"{EXTENDS}:") :]  # the template's own header out
    header = (
        f"# Profile {name!r}, written by `sat profile new`: your photos in {images}, captions\n"
        f"# from {captions} ({n_images} images). Run: make run PROFILE={name}; then\n"
        f"# sat caption --params profiles/{name}/params.yaml photo.jpg. What is not here is\n"
        "# ../../params.yaml's; what is, your photos' and the Flickr8k profile's values (real\n"
        "# photographs, chosen on its dev split; docs/decisions/). Expected time of `make run`\n"
        "# on 2 CPU cores, scaled from that profile's measured run (docs/results.md):\n"
        f"# ~{_minutes(n_images)} minutes.\n\n"
    )
    text = header + body
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(text, encoding="utf-8")
    (folder / "dvc.yaml").write_text(profile_dvc_text(project_root, folder), encoding="utf-8")
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
    stale = False
    for folder in profiles(args.root):
        try:
            text = profile_dvc_text(args.root, folder)
        except ProfileError as e:
            print(f"{folder.name}: {e}", file=sys.stderr)
            return 1
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
