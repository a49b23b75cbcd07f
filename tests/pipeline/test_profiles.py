"""Dataset profiles (profiles/<name>/): a params file and a dvc.yaml that stay in step with the
root pipeline, and the Flickr8k profile's prepare stage on the real train and dev photos."""

import json
from pathlib import Path

import pytest
import yaml

from pipeline.profiles import main, profile_dvc, profile_dvc_text, profiles
from pipeline.stages import load_context
from pipeline.stages.prepare import run as prepare
from sat_model.config import load_params
from sat_model.paths import shared_data

ROOT = Path(__file__).resolve().parents[2]
PROFILES = profiles(ROOT)


def _key_paths(tree: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths |= _key_paths(value, f"{path}.") if isinstance(value, dict) else {path}
    return paths


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_flickr8k_profile_exists() -> None:
    assert ROOT / "profiles" / "flickr8k" in PROFILES


@pytest.mark.parametrize("folder", PROFILES, ids=[p.name for p in PROFILES])
def test_profile_dvc_yaml_is_the_root_pipeline_as_written_now(folder: Path) -> None:
    assert (folder / "dvc.yaml").read_text(encoding="utf-8") == profile_dvc_text(ROOT), (
        f"{folder.name}/dvc.yaml is stale: run python -m pipeline.profiles"
    )
    assert main(["--check", "--root", str(ROOT)]) == 0


@pytest.mark.parametrize("folder", PROFILES, ids=[p.name for p in PROFILES])
def test_profile_params_hold_every_root_key_and_validate(folder: Path) -> None:
    root_keys = _key_paths(_yaml(ROOT / "params.yaml"))
    profile_keys = _key_paths(_yaml(folder / "params.yaml"))
    assert profile_keys == root_keys, (
        f"only in {folder.name}: {sorted(profile_keys - root_keys)}; "
        f"only in the root params.yaml: {sorted(root_keys - profile_keys)}"
    )
    load_params(folder / "params.yaml")  # raises ParamsError naming every bad value


def test_library_deps_climb_to_the_repository_and_data_deps_stay_in_the_profile() -> None:
    root_dvc = {
        "stages": {
            "train": {
                "cmd": "python -m pipeline.stages.train --params params.yaml",
                "deps": [
                    "data/features",
                    "pipeline/stages/train.py",
                    "sat_model",
                    "sat_model/x.py",
                ],
                "outs": ["models/soft"],
            }
        }
    }
    stage = profile_dvc(root_dvc)["stages"]["train"]
    assert stage["deps"] == [
        "data/features",
        "../../pipeline/stages/train.py",
        "../../sat_model",
        "../../sat_model/x.py",
    ]
    assert stage["outs"] == ["models/soft"] and stage["cmd"] == root_dvc["stages"]["train"]["cmd"]
    # DVC collects metrics and plots from every dvc.yaml: a profile never run would make a
    # bare `dvc metrics show` warn about its missing files
    root_dvc["metrics"] = ["reports/soft/metrics.json"]
    assert set(profile_dvc(root_dvc)) == {"stages"}
    assert root_dvc["stages"]["train"]["deps"][1] == "pipeline/stages/train.py"  # not mutated


def test_every_library_dep_of_a_profile_exists() -> None:
    for folder in PROFILES:
        for name, stage in _yaml(folder / "dvc.yaml")["stages"].items():
            for dep in stage.get("deps", []):
                if dep.startswith("../"):
                    assert (folder / dep).exists(), f"{folder.name}:{name}: {dep} does not exist"


def test_the_flickr8k_profile_prepares_the_real_train_and_dev_splits(tmp_path: Path) -> None:
    """The profile's own params, run from its folder: data.root must reach the shared photos."""
    folder = ROOT / "profiles" / "flickr8k"
    params = load_params(folder / "params.yaml")
    expected = (folder / params.data.root).resolve()
    if expected != shared_data("flickr8k-trainval").resolve() or not expected.is_dir():
        pytest.skip(f"Flickr8k train+dev not at {expected} (the profile reads ../shared/data)")
    ctx = load_context(folder / "params.yaml", [f"data.prepared_dir={tmp_path / 'prepared'}"])
    assert prepare(ctx) == 0
    report = json.loads((tmp_path / "prepared" / "prepare_report.json").read_text())
    assert (report["images_train"], report["images_val"], report["images_test"]) == (6000, 1000, 0)
    assert report["images_skipped"] == 0 and report["captions_total"] == 35_000
