"""``train_identity``: the stage's declared params and DVC's hashes of its deps, read from dvc.yaml.

A temporary project holds copies of ``dvc.yaml``, ``params.yaml`` and the code; nothing trains.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.settings import load_params
from pipeline.tracking.run_identity import train_identity
from tests.factories import ROOT


@pytest.fixture
def project(tmp_path: Path) -> Path:
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".dvc").mkdir()
    shutil.copy(ROOT / ".dvc" / "config", tmp_path / ".dvc" / "config")
    for package in ("pipeline", "sat_model"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__py*"))
    return tmp_path


def _declared(project: Path, attention: str) -> set[str]:
    stage = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]["train"]
    return {key.replace("${item.attention}", attention) for key in stage["params"]}


def test_identity_holds_every_declared_param_and_dvc_md5_of_every_dep(project: Path) -> None:
    params = load_params(project / "params.yaml")
    identity = train_identity(params, "hard", project)
    assert set(identity.inputs["params"]) == _declared(project, "hard")
    assert identity.inputs["params"]["eval.batch_size"] == params.eval.batch_size
    # a file dep is its md5; a folder dep (the model's code) DVC's directory hash, which
    # follows every file in it
    config_py = (project / "sat_model" / "config.py").read_bytes()
    assert identity.inputs["deps"]["sat_model/config.py"] == hashlib.md5(config_py).hexdigest()
    folder = identity.inputs["deps"]["sat_model/model"]
    assert folder.endswith(".dir")
    with (project / "sat_model" / "model" / "decoder.py").open("a") as f:
        f.write("# one more line\n")
    assert train_identity(params, "hard", project).inputs["deps"]["sat_model/model"] != folder
    assert identity.inputs["deps"]["data/features"] == "missing"  # not extracted here
    assert set(identity.inputs["versions"]) == {"torch", "sat"}


def test_identity_changes_with_declared_params_and_code_only(project: Path) -> None:
    params = load_params(project / "params.yaml")
    base = train_identity(params, "soft", project).digest
    undeclared = load_params(project / "params.yaml", ["eval.beam_size=2", "train.hard.lr=0.5"])
    assert train_identity(undeclared, "soft", project).digest == base
    # model.backend: the native and readable paths draw and round differently (test_backend.py)
    changes = (
        "eval.batch_size=7",
        "train.soft.lr=0.5",
        "ray.num_workers=3",
        "model.backend=readable",
    )
    for change in changes:
        changed = load_params(project / "params.yaml", [change])
        assert train_identity(changed, "soft", project).digest != base, change
    with (project / "sat_model" / "model" / "decoder.py").open("a") as f:
        f.write("# one more line\n")
    assert train_identity(params, "soft", project).digest != base
    # and the declared list is read from dvc.yaml: a key added there joins the identity
    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    spec["stages"]["train"]["params"].append("eval.beam_size")
    (project / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    assert "eval.beam_size" in train_identity(params, "soft", project).inputs["params"]
