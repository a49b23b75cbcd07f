"""The suite's own layout: tests mirror the packages, no folder is flat, and shared helpers live
in helper modules (``factories``, ``figures``, ``pipeline/servers``, ``pipeline/ray_cluster``,
``pipeline/projects``), never in another test module."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.factories import ROOT

TESTS = ROOT / "tests"
MAX_MODULES = 12


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _test_module_imports(path: Path) -> list[str]:
    return sorted(
        name
        for name in _imported_modules(path)
        if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")
    )


def test_no_test_module_imports_another_test_module() -> None:
    modules = _test_modules()
    assert len(modules) > 50, "the scan found too few test modules to mean anything"
    found = {str(path.relative_to(ROOT)): _test_module_imports(path) for path in modules}
    assert {module: names for module, names in found.items() if names} == {}


def test_the_import_check_sees_imports_at_any_depth(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(
        "from tests.factories import ROOT\n"
        "def test_y():\n"
        "    from tests.pipeline.serving.test_serving import png_bomb\n"
        "    import tests.sat_model.model.test_model\n"
    )
    assert _test_module_imports(module) == [
        "tests.pipeline.serving.test_serving",
        "tests.sat_model.model.test_model",
    ]


def test_no_folder_holds_more_than_twelve_test_modules() -> None:
    counts = {
        str(folder.relative_to(ROOT)): len(list(folder.glob("test_*.py")))
        for folder in [TESTS, *(p for p in TESTS.rglob("*") if p.is_dir())]
        if "__pycache__" not in folder.parts
    }
    assert {f: n for f, n in counts.items() if n > MAX_MODULES} == {}


def test_test_folders_mirror_the_packages() -> None:
    """Each folder under tests/sat_model and tests/pipeline names a package of the project."""
    for package in ("sat_model", "pipeline"):
        for folder in (TESTS / package).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__":
                twin = ROOT / folder.relative_to(TESTS)
                assert (twin / "__init__.py").is_file(), f"{folder} mirrors no package ({twin})"
