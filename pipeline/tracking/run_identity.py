"""A training run's identity: everything the ``train@<attention>`` stage depends on, as one digest.

The stage's definition is read with DVC from ``dvc.yaml`` (the project's own, else the one beside
this package's source, where that is a DVC project), so the identity follows the declared ``deps``
and ``params`` when ``dvc.yaml`` changes. Its parts:

- ``params``: the value of every key the stage declares, taken from the params the run was given
  (``-S`` overrides included), not from ``params.yaml`` on disk;
- ``deps``: DVC's own md5 (``Dependency.get_hash``, the hash ``dvc.lock`` records; a folder is
  its ``.dir`` hash) of every declared dependency and of every input the params point at
  (captions and vocabulary under ``data.prepared_dir``, ``encoder.features_dir``, a
  ``--resume-from`` folder), ``"missing"`` where the path does not exist; DVC's state database
  makes a re-hash of unchanged files cheap;
- ``versions``: of torch and of this project.

Reading the stage and hashing take no DVC lock, so this works while ``dvc repro`` holds it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.settings import Params

__all__ = ["RunIdentity", "train_identity"]

_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding pipeline/ and dvc.yaml
_PARAMS_FILE = "params.yaml"


@dataclass(frozen=True)
class RunIdentity:
    """``digest`` (sha256 hex) of ``inputs``: {"stage", "params", "deps", "versions"}."""

    digest: str
    inputs: dict[str, Any]

    @property
    def short(self) -> str:
        return self.digest[:12]


def train_identity(
    params: Params,
    attention: str,
    project_root: Path,
    *,
    inputs: Iterable[Path] = (),
) -> RunIdentity:
    """The identity of ``train@<attention>`` run in ``project_root`` with ``params``.

    ``inputs`` are absolute paths the run reads beyond the declared deps (they are hashed too).
    """
    from dvc.dependency import Dependency, ParamsDependency
    from dvc.repo import Repo

    stage_name = f"train@{attention}"
    project_root = project_root.resolve()
    dvc_root = next((r for r in (project_root, _SOURCE_ROOT) if _is_dvc_project(r)), None)
    if dvc_root is None:
        raise FileNotFoundError(
            f"neither {project_root} nor {_SOURCE_ROOT} is a DVC project (dvc.yaml and .dvc/): "
            f"the train stage's dependencies are read from its definition there"
        )
    # no_scm: git is not needed to read a stage and hash files (an exported tree has none)
    with Repo(str(dvc_root), config={"core": {"no_scm": True}}) as repo:
        stage = repo.stage.collect(f"{dvc_root / 'dvc.yaml'}:{stage_name}")[0]
        declared: list[str] = []
        paths: set[str] = {str(Path(p).resolve()) for p in inputs}
        other_params: dict[str, Any] = {}
        for dep in stage.deps:
            if not isinstance(dep, ParamsDependency):
                paths.add(str(Path(dep.fs_path).resolve()))
            elif Path(dep.fs_path).name == _PARAMS_FILE and Path(dep.fs_path).parent == dvc_root:
                declared += dep.params or ["."]
            else:  # another params file: DVC reads it
                other_params[dep.def_path] = dep.read_params()
        deps = {_label(p, dvc_root): _md5(Dependency(stage, p)) for p in sorted(paths)}
    blob = {
        "stage": stage_name,
        "params": {**_declared_values(params, declared), **other_params},
        "deps": deps,
        "versions": {"torch": torch.__version__, "sat": importlib.metadata.version("sat")},
    }
    text = json.dumps(blob, sort_keys=True, default=str)
    return RunIdentity(hashlib.sha256(text.encode()).hexdigest(), json.loads(text))


def _is_dvc_project(root: Path) -> bool:
    return (root / "dvc.yaml").is_file() and (root / ".dvc").is_dir()


def _md5(dep: Any) -> str:
    if not Path(dep.fs_path).exists():
        return "missing"
    try:
        return str(dep.get_hash().value)
    except FileNotFoundError:
        return "missing"


def _label(path: str, root: Path) -> str:
    # relative to the project where possible: the identity does not depend on where it is cloned
    p = Path(path)
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix()


def _declared_values(params: Params, keys: list[str]) -> dict[str, Any]:
    """``{dotted key: value}`` for each declared key (``"."``: the whole params)."""
    tree = params.model_dump(mode="json")
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = tree
        for part in [] if key == "." else key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise KeyError(f"dvc.yaml declares param {key!r}, which params do not have")
            node = node[part]
        out[key] = node
    return out
