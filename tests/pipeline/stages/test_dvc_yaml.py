"""dvc.yaml's deps list every project module a stage runs, so a code change re-runs the stage.

The modules a stage runs are found from its command (``python -m pipeline.stages.X``) by
following the project's own imports (including imports inside functions) through the AST.
"""

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.factories import ROOT

PACKAGES = ("sat_model", "pipeline")


def _module_path(name: str) -> Path | None:
    """The file of module ``name``: ``a/b.py``, or ``a/b/__init__.py`` for a package."""
    base = ROOT / name.replace(".", "/")
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports(path: Path) -> set[str]:
    package = path.relative_to(ROOT).parent.as_posix().replace("/", ".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    return {n for n in found if n.split(".")[0] in PACKAGES}


def project_closure(module: str) -> set[str]:
    """Relative paths of every project module ``module`` imports, transitively."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        path = _module_path(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += _imports(path)
    return {p.relative_to(ROOT).as_posix() for p in seen if p.name != "__init__.py"}


def _stages(dvc_file: Path) -> list[tuple[str, dict]]:
    spec = yaml.safe_load(dvc_file.read_text(encoding="utf-8"))
    return list(spec["stages"].items())


STAGES = [
    (f"{f.relative_to(ROOT)}:{name}", stage)
    for f in (ROOT / "dvc.yaml", ROOT / "sweeps" / "dvc.yaml")
    if f.exists()
    for name, stage in _stages(f)
]


@pytest.mark.parametrize(("name", "stage"), STAGES, ids=[n for n, _ in STAGES])
def test_stage_deps_list_every_project_module_it_runs(name: str, stage: dict) -> None:
    match = re.search(r"python -m ([\w.]+)", stage["cmd"])
    assert match, f"{name}: command does not run a project module: {stage['cmd']}"
    needed = project_closure(match.group(1))
    assert needed, f"{name}: {match.group(1)} not found"
    deps = {d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])}
    # a directory dep covers every module under it
    missing = sorted(n for n in needed - deps if not any(n.startswith(f"{d}/") for d in deps))
    assert not missing, f"{name} runs these modules but does not list them as deps: {missing}"
    project = tuple(f"{p}/" for p in PACKAGES)
    stale = sorted(d for d in deps if d.startswith(project) and not (ROOT / d).exists())
    # a dep on a module the stage never imports is allowed (e.g. copied into a model) but not a
    # module or package folder that does not exist
    assert not stale, f"{name} lists modules that do not exist: {stale}"


def _has_key(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize(("name", "stage"), STAGES, ids=[n for n, _ in STAGES])
def test_every_stage_param_is_written_out_in_params_yaml(name: str, stage: dict) -> None:
    # DVC reads params.yaml itself, not our defaults: a declared key must be in the file
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    keys = []
    for entry in stage.get("params", []):
        keys += [entry] if isinstance(entry, str) else next(iter(entry.values()))
    attentions = stage.get("matrix", {}).get("attention", [None])
    missing = [
        key.replace("${item.attention}", str(a))
        for key in keys
        for a in attentions
        if not _has_key(params, key.replace("${item.attention}", str(a)))
    ]
    assert not missing, f"{name}: params.yaml lacks {missing}"


@pytest.mark.parametrize(
    ("dvc_file", "params_files"),
    [
        ("dvc.yaml", ["params.yaml"]),
        ("sweeps/dvc.yaml", ["params.yaml"]),  # the sweep runs in the repository root (wdir: ..)
        # a profile's own keys, and the root's it extends
        ("profiles/flickr8k/dvc.yaml", ["profiles/flickr8k/params.yaml", "params.yaml"]),
    ],
)
def test_every_params_file_a_stage_reads_is_the_committed_one(
    dvc_file: str, params_files: list[str]
) -> None:
    """DVC resolves a stage's params file against the stage's wdir, as it runs it: a path that
    points elsewhere fails `dvc repro` at once ("Parameters ... are missing")."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = repo.stage.collect(str(ROOT / dvc_file))
        files = {Path(d.fs_path) for s in stages for d in s.deps if isinstance(d, ParamsDependency)}
    expected = {ROOT / f for f in params_files}
    assert files == expected, f"{dvc_file}: stages read {sorted(map(str, files))}"


def test_the_committed_dvc_lock_is_current_with_the_code_and_params(tmp_path: Path) -> None:
    """`dvc status` in a fresh clone (what `git clone` then `dvc pull` gives) reports no code or
    params change against dvc.lock: every output is missing there, and only outputs may differ.
    After a change to a stage's code or params, dvc.lock is regenerated with `make run`."""
    import json
    import subprocess
    import sys

    from tests.factories import copy_project

    clone = copy_project(tmp_path / "clone")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("dvc")), "status", "dvc.yaml", "--json"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    stale = {
        f"{stage}: {path}"
        for stage, changes in json.loads(done.stdout or "{}").items()
        for change in changes
        if isinstance(change, dict)
        for path in change.get("changed deps", {})
        if not path.startswith(("data/", "models/", "reports/"))  # outputs of earlier stages
    }
    assert not stale, f"dvc.lock is stale, regenerate it with `make run`: {sorted(stale)}"
