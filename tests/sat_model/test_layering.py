"""The library layer never loads orchestration packages (STYLE.md, 'In this project' 1)."""

import subprocess
import sys

import pytest

MODULES = [
    "sat_model",
    "sat_model.config",
]


@pytest.mark.parametrize("module", MODULES)
def test_sat_model_module_loads_no_orchestration_package(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'ray', 'mlflow', 'dvc'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} loaded {out.stdout.strip()}"
