"""The code's shape, as STYLE.md asks it: modules under 450 lines, functions under 60 lines and
8 parameters, and no import cycle in ``sat_model/`` or ``pipeline/``, counting the imports
inside functions and under ``TYPE_CHECKING`` (a reader follows those too)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.factories import ROOT

PACKAGES = ("sat_model", "pipeline")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
# known and to be fixed: a signature shared by the registration code of another branch of work
# (the model card's), left as it is until that lands; the check holds it to its present count
WIDE_FOR_NOW = {"pipeline/tracking/packaging.py:log_and_register": 11}


def _files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Named parameters, ``self``/``cls`` aside, then ``*args`` and ``**kwargs``."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names + [f"*{x.arg}" for x in (a.vararg, a.kwarg) if x is not None]


def test_the_shape_checks_see_the_code() -> None:
    # guards the checks below from passing on an empty tree
    names = {_module_name(p) for p in _files()}
    assert {"sat_model.config", "pipeline.cli.main", "sat_model.train.run"} <= names


def test_no_module_is_over_450_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _files()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_takes_more_than_8_parameters_or_runs_over_60_lines() -> None:
    wide, long = [], []
    for path in _files():
        for node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            allowed = WIDE_FOR_NOW.get(f"{path.relative_to(ROOT)}:{node.name}", MAX_PARAMETERS)
            if len(_parameters(node)) > allowed:
                wide.append(f"{where} ({len(_parameters(node))})")
            assert node.end_lineno is not None
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    assert not wide, f"functions over {MAX_PARAMETERS} parameters: {wide}"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere (top level, functions, TYPE_CHECKING);
    ``from package import module`` names the module, relative imports resolve."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = {f"{base}.{alias.name}" for alias in node.names}
            found |= (names & modules) or {base}
    return (found & modules) - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path) for each module that reaches itself."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], {start}
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append([*path, start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c[0] for c in _cycles(graph)] == ["a", "b", "c"]


def test_no_import_cycle_lazy_and_type_checking_imports_included() -> None:
    files = {_module_name(p): p for p in _files()}
    modules = set(files)
    graph = {name: _imports(path, name, modules) for name, path in files.items()}
    assert "sat_model.train.phases" in graph["sat_model.train.run"]  # the graph sees imports
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
