"""The library layer never loads orchestration packages (docs/ARCHITECTURE.md, "Layers")."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import sat_model

ORCHESTRATION = {"ray", "mlflow", "dvc"}


def _all_modules() -> list[str]:
    root = Path(sat_model.__file__).parent
    return ["sat_model"] + [f"sat_model.{m.name}" for m in pkgutil.iter_modules([str(root)])]


def test_sat_model_has_the_modules_it_promises() -> None:
    # guards the module list below from silently shrinking to nothing
    assert {"sat_model.config", "sat_model.model"} <= set(_all_modules())


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
