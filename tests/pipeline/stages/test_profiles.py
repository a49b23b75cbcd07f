"""Dataset profiles (profiles/<name>/): a params file that holds only what differs from the root
one, a dvc.yaml that stays in step with the root pipeline and tracks both params files, and the
Flickr8k profile's prepare stage on the real train and dev photos."""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.settings import load_params
from pipeline.stages import load_context
from pipeline.stages.prepare import run as prepare
from pipeline.stages.profiles import (
    Layers,
    ProfileError,
    main,
    profile_dvc,
    profile_dvc_text,
    profiles,
)
from sat_model.params import EXTENDS
from sat_model.paths import shared_data
from tests.factories import ROOT, copy_project

PROFILES = profiles(ROOT)


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Every leaf of ``tree`` by its dotted key."""
    leaves: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        leaves |= _leaves(value, f"{path}.") if isinstance(value, dict) else {path: value}
    return leaves


def _assert_overlay(params_file: Path) -> None:
    """``params_file`` extends the root params and sets only keys the root has, each to a value
    of its own."""
    own = _yaml(params_file)
    assert own.pop(EXTENDS) == "../../params.yaml"
    root, leaves = _leaves(_yaml(ROOT / "params.yaml")), _leaves(own)
    assert not set(leaves) - set(root), f"not root keys: {sorted(set(leaves) - set(root))}"
    same = sorted(k for k, v in leaves.items() if root[k] == v)
    assert not same, f"{params_file} repeats the root's values of {same}"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_flickr8k_profile_exists() -> None:
    assert ROOT / "profiles" / "flickr8k" in PROFILES


@pytest.mark.parametrize("folder", PROFILES, ids=[p.name for p in PROFILES])
def test_profile_dvc_yaml_is_the_root_pipeline_as_written_now(folder: Path) -> None:
    assert (folder / "dvc.yaml").read_text(encoding="utf-8") == profile_dvc_text(ROOT, folder), (
        f"{folder.name}/dvc.yaml is stale: run python -m pipeline.stages.profiles"
    )
    assert main(["--check", "--root", str(ROOT)]) == 0


@pytest.mark.parametrize("folder", PROFILES, ids=[p.name for p in PROFILES])
def test_profile_params_hold_only_what_differs_from_the_root_and_validate(folder: Path) -> None:
    _assert_overlay(folder / "params.yaml")
    load_params(folder / "params.yaml")  # raises ParamsError naming every bad value


ROOT_PARAMS = {
    "data": {"source": "synthetic", "vocab": {"min_count": 5, "max_size": 10}, "seed": 0},
    "model": {"dim": 8, "gate": True},
    "train": {"seed": 0, "soft": {"lr": 1.0, "beta": 1}, "hard": {"lr": 1.0, "gamma": 2}},
}
ROOT_STAGES = {
    "prepare": {"cmd": "prepare", "params": ["data"]},
    "train": {
        "matrix": {"attention": ["soft", "hard"]},
        "cmd": "train ${item.attention}",
        "params": ["data.source", "model.dim", "train.seed", "train.${item.attention}"],
    },
}


def test_each_stage_param_is_tracked_in_the_file_that_sets_it() -> None:
    """The profile's file for what it sets, the root's for the rest (a section the profile sets
    in part: the rest key by key), so a root change the profile overrides re-runs nothing."""
    own = {"data": {"source": "flickr8k", "vocab": {"min_count": 1}}, "train": {"soft": {"lr": 2}}}
    own["train"]["hard"] = {}  # an empty section: DVC gives both items of a matrix one list
    layers = Layers(own, "../../params.yaml", ROOT_PARAMS)
    stages = profile_dvc({"stages": ROOT_STAGES}, layers)["stages"]
    assert stages["prepare"]["params"] == [
        "data",
        {"../../params.yaml": ["data.vocab.max_size", "data.seed"]},
    ]
    assert stages["train"]["params"] == [
        "data.source",
        "train.${item.attention}",
        # tracked whole: soft and hard hold different keys, and a matrix gives one list
        {"../../params.yaml": ["model.dim", "train.seed", "train.${item.attention}"]},
    ]
    del own["train"]["hard"]
    with pytest.raises(ProfileError, match=r"train\.hard an empty section"):
        profile_dvc({"stages": ROOT_STAGES}, layers)
    # a profile that holds every key itself (no `extends`) tracks its own file alone
    full = profile_dvc({"stages": ROOT_STAGES}, Layers(ROOT_PARAMS))["stages"]
    assert full["train"]["params"] == ROOT_STAGES["train"]["params"]


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


def _clone_with_profile(tmp_path: Path, name: str = "flickr8k") -> Path:
    """A project root holding the Makefile, the profile's params, the root params it extends and
    the environment: all that ``make run PROFILE=<name>`` opens before its first stage."""
    project = tmp_path / "sat"
    (project / "profiles" / name).mkdir(parents=True)
    for rel in ("Makefile", "params.yaml", f"profiles/{name}/params.yaml"):
        shutil.copy2(ROOT / rel, project / rel)
    (project / ".venv").symlink_to(ROOT / ".venv")
    return project


def test_make_run_of_a_profile_without_its_dataset_stops_in_one_line_before_any_ray_head(
    tmp_path: Path,
) -> None:
    project = _clone_with_profile(tmp_path)
    run = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "run", "PROFILE=flickr8k"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        # as a user's shell runs it, not as a sub-make of `make test` (make[1]: ...)
        env={
            **{k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS")},
            "PYTHONPATH": str(ROOT),
        },
    )
    assert run.returncode != 0
    lines = run.stderr.splitlines()
    # the line, then make's own
    assert len(lines) == 2 and lines[1].startswith("make: *** "), run.stderr
    where = project / "datasets" / "flickr8k"
    assert lines[0].startswith(f"ray_head: Flickr8k: data.root {where} is not a folder. Get ")
    assert "https://" in lines[0] and "Flickr8k_Dataset/" in lines[0]
    assert "Ray head on" not in run.stdout and "Traceback" not in run.stderr + run.stdout


def test_prepared_data_already_there_needs_no_dataset_to_start_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dvc pull` of data/prepared on a machine without Flickr8k: make run goes on (a cluster
    given by address, so no head is started; the command run is `true`)."""
    from pipeline.ray.head import main as head

    params = _clone_with_profile(tmp_path) / "profiles" / "flickr8k" / "params.yaml"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert head(["--params", str(params), "--", "true"]) == 1
    assert "Flickr8k: data.root " in capsys.readouterr().err
    (params.parent / "data" / "prepared").mkdir(parents=True)
    assert head(["--params", str(params), "--", "true"]) == 0
    assert capsys.readouterr().err == ""


def test_the_profiles_prepare_stage_without_its_dataset_says_the_same_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `dvc repro profiles/flickr8k/dvc.yaml` runs first."""
    params = _clone_with_profile(tmp_path) / "profiles" / "flickr8k" / "params.yaml"
    assert prepare(load_context(params, [])) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prepare: error: Flickr8k: data.root ")
    assert not (params.parent / "data").exists()


@pytest.mark.slow
def test_the_flickr8k_profile_prepares_its_dataset_placed_in_datasets(tmp_path: Path) -> None:
    """The profile's own params, in a project whose datasets/flickr8k is our copy of the train
    and dev photos, linked in as the datasets guide says."""
    ours = shared_data("flickr8k-trainval")
    if not ours.is_dir():
        pytest.skip(f"Flickr8k train+dev not at {ours} (../shared/data or $SAT_SHARED_DATA)")
    project = _clone_with_profile(tmp_path)
    (project / "datasets").mkdir()
    (project / "datasets" / "flickr8k").symlink_to(ours, target_is_directory=True)
    ctx = load_context(project / "profiles" / "flickr8k" / "params.yaml", [])
    assert prepare(ctx) == 0
    prepared = project / "profiles" / "flickr8k" / "data" / "prepared"
    report = json.loads((prepared / "prepare_report.json").read_text())
    assert (report["images_train"], report["images_val"], report["images_test"]) == (6000, 1000, 0)
    assert report["images_skipped"] == 0 and report["captions_total"] == 35_000


def _own_project(tmp_path: Path) -> Path:
    """A project root with the files `sat profile new` reads, and a folder of 20 photos."""
    project = tmp_path / "sat"
    (project / "profiles" / "flickr8k").mkdir(parents=True)
    for rel in ("dvc.yaml", "params.yaml", "profiles/flickr8k/params.yaml"):
        (project / rel).write_text((ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    photos = tmp_path / "photos"
    photos.mkdir()
    rows = "".join(f"p{i}.jpg,a photo {i}\n" for i in range(20))
    (tmp_path / "captions.csv").write_text("file,caption\n" + rows)
    return project


def test_sat_profile_new_writes_a_profile_of_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli.main import main as sat

    project = _own_project(tmp_path)
    monkeypatch.chdir(project)
    images, captions = str(tmp_path / "photos"), str(tmp_path / "captions.csv")
    assert sat(["profile", "new", "mine", "--images", images, "--captions", captions]) == 0
    assert "make run PROFILE=mine" in capsys.readouterr().out
    folder = project / "profiles" / "mine"
    assert (folder / "dvc.yaml").read_text(encoding="utf-8") == profile_dvc_text(project, folder)
    _assert_overlay(folder / "params.yaml")
    data = load_params(folder / "params.yaml").data
    assert (data.source, data.folder.images_dir) == ("folder", ".")
    assert (folder / data.root).resolve() == (tmp_path / "photos").resolve()  # type: ignore[operator]
    captions_path = folder / data.root / data.folder.captions_file  # type: ignore[operator]
    assert captions_path.resolve() == (tmp_path / "captions.csv").resolve()
    assert (data.folder.val_images, data.folder.test_images) == (2, 2)  # a tenth of 20 each
    assert data.root == "../../../photos"  # beside the project: moves with it
    assert load_params(folder / "params.yaml").mlflow.model_name == "sat-captioner-mine"
    # the comments of the lines it did not change are the template's
    assert "# m (paper: 512)" in (folder / "params.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["new", "mine", "--images", "{tmp}/photos"], "required: --captions"),
        (["new", "Mine!", "--images", "{tmp}/photos", "--captions", "{tmp}/captions.csv"], "name"),
        (["new", "x", "--images", "{tmp}/nowhere", "--captions", "{tmp}/captions.csv"], "nowhere"),
        (["new", "x", "--images", "{tmp}/photos", "--captions", "{tmp}/none.csv"], "none.csv"),
        (
            ["new", "flickr8k", "--images", "{tmp}/photos", "--captions", "{tmp}/captions.csv"],
            "exists already",
        ),
        (["new", "x", "--images", "{tmp}/photos", "--captions", "{tmp}/photos"], "not a file"),
        (["new", "x", "--images", "{tmp}/photos", "--captions", "{tmp}/bad.csv"], "no column"),
        (
            ["new", "x", "--images", "{tmp}/pho\ntos", "--captions", "{tmp}/captions.csv"],
            "a newline or control character in a path",
        ),
    ],
)
def test_sat_profile_new_refuses_bad_arguments_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    from pipeline.cli.main import main as sat

    project = _own_project(tmp_path)
    (tmp_path / "bad.csv").write_text("name,text\na.jpg,x\n")
    shutil.copytree(tmp_path / "photos", tmp_path / "pho\ntos")  # a real folder of the photos
    monkeypatch.chdir(project)
    before = sorted(p.name for p in (project / "profiles").iterdir())
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(sat(["profile", *(a.format(tmp=tmp_path) for a in args)]))
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("sat profile: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err
    assert sorted(p.name for p in (project / "profiles").iterdir()) == before


def test_overlay_text_sets_adds_and_drops_keys_in_dvcs_form() -> None:
    from pipeline.stages.profiles import overlay_text

    template = "extends: base.yaml\na:\n  b: 1   # why b\n  c:  # why c\n  - x\n  - y\nd: 2\n"
    base = {"a": {"b": 0, "c": ["z"], "e": None}, "d": 2, "f": {"g": 1}}
    out = overlay_text(template, {"a.c": ["z"], "f.g": 3, "f.h": 4}, base, "set")
    # a.c and d are the base's values now: left out; f.g and f.h added; a.b keeps its comment
    assert " ".join(out.split()) == "extends: base.yaml a: b: 1 # why b f: g: 3 # set h: 4 # set"
    # DVC's block form, as `dvc exp run -S` writes the file back: a list one item a line
    out = overlay_text(template, {"a.c": ["q"], "a.e": None}, base, "set")
    assert out.endswith("\n  c:     # set\n  - q\n") and "e:" not in out


def test_photos_away_from_the_project_are_named_by_absolute_path(tmp_path: Path) -> None:
    from pipeline.stages.profiles import new_profile

    project = _own_project(tmp_path)
    project.rename(tmp_path / "away")
    moved = tmp_path / "away"
    folder = new_profile(moved, "far", tmp_path / "photos", tmp_path / "captions.csv")
    data = load_params(folder / "params.yaml").data
    # the project's parent is tmp_path here, so the photos lie in it: relative
    assert data.root == "../../../photos"
    nested = tmp_path / "deep" / "er"
    nested.mkdir(parents=True)
    project = moved.rename(nested / "sat")
    folder = new_profile(project, "far2", tmp_path / "photos", tmp_path / "captions.csv")
    data = load_params(folder / "params.yaml").data
    assert data.root == str((tmp_path / "photos").resolve())
    assert data.folder.captions_file == "../captions.csv"  # beside the photos folder


_STUB = """import pathlib, sys
for out in map(pathlib.Path, sys.argv[2:]):  # each output, with the files later stages read
    if out.suffix:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("{}")
        continue
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1].split(","):
        (out / name).write_text("{}")
"""


def _set(params_file: Path, dotted: str, value: Any) -> None:
    """Set one key as a user's editor would: that line changes, the rest stays."""
    from ruamel.yaml import YAML

    writer = YAML()
    tree = writer.load(params_file.read_text(encoding="utf-8"))
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[leaf] = value
    out = io.StringIO()
    writer.dump(tree, out)
    params_file.write_text(out.getvalue(), encoding="utf-8")


def _changed_params(project: Path, dvc_file: str) -> dict[str, list[str]]:
    """`dvc status` of a pipeline: each stage with changed params, and which."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("dvc")), "status", dvc_file, "--json"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    changed: dict[str, list[str]] = {}
    for stage, changes in json.loads(done.stdout or "{}").items():
        deps = [c["changed deps"] for c in changes if isinstance(c, dict) and "changed deps" in c]
        for path, what in (item for d in deps for item in d.items()):
            if isinstance(what, dict):  # a params file: {key: modified}
                changed.setdefault(stage.split(":")[-1], []).extend(f"{path}:{k}" for k in what)
    return changed


@pytest.mark.slow
def test_dvc_reruns_the_profile_stages_that_read_a_changed_root_or_profile_key(
    tmp_path: Path,
) -> None:
    """The Flickr8k profile's generated dvc.yaml, its real params and deps, with each command a
    stub that writes the stage's outputs: after `dvc repro`, `dvc status` names the stages a
    root key the profile inherits, and one it sets itself, feed; a root key it overrides, none."""
    project = copy_project(tmp_path / "sat")
    folder = project / "profiles" / "flickr8k"
    (folder / "dvc.lock").unlink(missing_ok=True)
    (project / "stub.py").write_text(_STUB)
    spec = _yaml(folder / "dvc.yaml")
    deps = [Path(d).name for stage in spec["stages"].values() for d in stage["deps"]]
    names = sorted({d for d in deps if d.endswith((".json", ".parquet"))})
    for stage in spec["stages"].values():
        outs = " ".join(stage["outs"])
        stage["cmd"] = f"{sys.executable} ../../stub.py {','.join(names)} {outs}"
    (folder / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    dvc = str(Path(sys.executable).with_name("dvc"))
    repro = subprocess.run(
        [dvc, "repro", "-q", "profiles/flickr8k/dvc.yaml"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert repro.returncode == 0, repro.stdout + repro.stderr
    assert _changed_params(project, "profiles/flickr8k/dvc.yaml") == {}

    _set(project / "params.yaml", "model.embed_dim", 64)  # the profile sets its own: 256
    assert _changed_params(project, "profiles/flickr8k/dvc.yaml") == {}
    _set(project / "params.yaml", "encoder.batch_size", 8)  # the profile takes the root's
    _set(folder / "params.yaml", "eval.length_penalty.hard", 1.5)  # the profile's own
    assert _changed_params(project, "profiles/flickr8k/dvc.yaml") == {
        "extract": ["params.yaml:encoder.batch_size"],
        "evaluate@soft": ["profiles/flickr8k/params.yaml:eval.length_penalty"],
        "evaluate@hard": ["profiles/flickr8k/params.yaml:eval.length_penalty"],
        "register": ["profiles/flickr8k/params.yaml:eval"],
    }
    # the root pipeline reads the root's change, not the profile's
    root = _changed_params(project, "dvc.yaml")
    assert "params.yaml:encoder.batch_size" in root["extract"]
    assert not [k for keys in root.values() for k in keys if k.startswith("profiles/")], root
