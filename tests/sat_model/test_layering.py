"""The library layer never loads orchestration packages (docs/ARCHITECTURE.md, "Layers")."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import sat_model

ORCHESTRATION = {"ray", "mlflow", "dvc"}


def _all_modules() -> list[str]:
    """Every module and subpackage of sat_model, at any depth."""
    root = Path(sat_model.__file__).parent
    found = pkgutil.walk_packages([str(root)], prefix="sat_model.")
    return ["sat_model", *sorted(m.name for m in found)]


def test_sat_model_has_the_modules_it_promises() -> None:
    # guards the module list below from silently shrinking to nothing
    modules = set(_all_modules())
    assert "sat_model.config" in modules
    assert any(m.startswith("sat_model.model.decoder") for m in modules - {"sat_model"})
    # every module file is found, in subpackages too
    root = Path(sat_model.__file__).parent
    files = {p for p in root.rglob("*.py") if p.name != "__init__.py"}
    assert len(files) <= len(modules), "walk_packages missed module files"


@pytest.mark.slow
def test_importing_every_sat_model_module_loads_no_orchestration_package() -> None:
    modules = _all_modules()
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {ORCHESTRATION!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"sat_model loaded {out.stdout.strip()}"
