"""Your own photos and captions, as the README's "Your own data" walks them: a folder of shared
Flickr8k-sample photos with a captions CSV holding every kind of bad row, the README's two
commands as written (`sat profile new`, then `make run PROFILE=mine`: one Ray head around the
profile's `dvc repro` of a tiny model, one epoch, to a registered champion, then `sat
summary`), and `sat caption` with the profile's params.

The project is a temporary git repository holding this working tree's files; the photos are
copied from ../shared/data into the test's temporary folder, never into the repository. As in
test_dvc_pipeline.py, three departures, all outside the commands' text: ``~/photos`` is that
folder, the profile's params are made tiny between the two commands, and ``.venv`` in the
project links to the environment running the tests (its ``pyproject.toml`` dated before that
environment's install, so make installs nothing)."""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sat_model.params import apply_overrides, read_yaml
from sat_model.paths import shared_data
from tests.factories import ROOT
from tests.pipeline.projects import METRIC_KEYS, project_for_make_run

SAMPLE = shared_data("flickr8k-sample")
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.mlflow,
    pytest.mark.java,
    pytest.mark.skipif(shutil.which("java") is None, reason="METEOR and PTB need Java"),
    pytest.mark.skipif(
        not (SAMPLE / "Flickr8k_text" / "Flickr8k.token.txt").is_file(),
        reason=f"shared Flickr8k sample not found at {SAMPLE} (set SAT_SHARED_DATA)",
    ),
]

PHOTOS, CAPTIONS_PER_PHOTO = 300, 2
# the smallest run that still trains, evaluates and registers both variants
TINY = [
    "data.folder.val_images=6",
    "data.folder.test_images=6",
    "encoder.name=random",
    "encoder.layer=null",
    "encoder.resize=64",
    "encoder.crop=64",
    "encoder.num_workers=0",
    "encoder.torch_threads=1",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.attention_dim=16",
    "train.val_images=4",
    "eval.beam_size=2",
    "eval.gallery_images=1",
    "ray.num_cpus=2",
    "ray.num_workers=1",
    "ray.cpus_per_worker=1",
    # a model this tiny scores next to nothing: the profile's floor would keep it from champion
    "promotion.floor.bleu_4=0.0",
    "promotion.floor.cider=0.0",
] + [
    f"train.{variant}.{key}"
    for variant in ("soft", "hard")
    for key in ("max_epochs=1", "scst_epochs=0", "patience=1", "batch_size=64")
]


def _env() -> dict[str, str]:
    # as a user's shell runs make, not as a sub-make of `make test`
    drop = ("MLFLOW_", "RAY_ADDRESS", "MAKELEVEL", "MAKEFLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    return env


def _bash(project: Path, line: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", line],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _readme_commands(photos: Path) -> list[str]:
    """The README's "Your own data" block, a command a line, with ``photos`` for ~/photos."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.partition("**Your own data**")[2].partition("```bash\n")[2].partition("```")[0]
    return [line.replace("~/photos", str(photos)) for line in block.splitlines()]


def _sample_captions() -> dict[str, list[str]]:
    captions: dict[str, list[str]] = {}
    token_file = SAMPLE / "Flickr8k_text" / "Flickr8k.token.txt"
    for line in token_file.read_text(encoding="utf-8").splitlines():
        name, _, caption = line.partition("\t")
        if len(caption.split()) <= 18:  # within data.vocab.max_caption_length: none is skipped
            captions.setdefault(name.rpartition("#")[0], []).append(caption)
    return {name: c for name, c in captions.items() if len(c) >= CAPTIONS_PER_PHOTO}


def _dataset(photos: Path) -> tuple[Path, dict[str, str]]:
    """300 photos and, among them, a CSV of 600 good rows and 30 bad ones (5 % of the good),
    five kinds, each kind's rows unique; returns the CSV and {file or line: expected reason}."""
    photos.mkdir(parents=True)
    captions = _sample_captions()
    names = sorted(captions)[:PHOTOS]
    for name in names:
        # copies: prepare refuses a symbolic link out of the photo folder
        shutil.copyfile(SAMPLE / "Flickr8k_Dataset" / name, photos / name)
    rows = [(n, c) for n in names for c in captions[n][:CAPTIONS_PER_PHOTO]]
    bad: list[tuple[tuple[str, str], str, str]] = []  # (row, named by, reason)
    for i in range(6):
        bad.append(((f"missing_{i}.jpg", "a dog runs"), f"missing_{i}.jpg", "missing image file"))
        if i < 3:
            (photos / f"broken_{i}.jpg").write_bytes(b"\xff\xd8 this is not a JPEG")
            bad.append(
                ((f"broken_{i}.jpg", "a dog runs"), f"broken_{i}.jpg", "not a readable image")
            )
        bad.append(((names[i], "   "), "line", "empty caption"))
        bad.append(((f"../outside_{i}.jpg", "a dog"), f"../outside_{i}.jpg", "leaves the dataset"))
    for i in range(9):
        bad.append(((names[10 + i], captions[names[10 + i]][0]), "line", "duplicate row"))
    csv_path = photos / "captions.csv"
    expected: dict[str, str] = {}
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "caption"])
        writer.writerows(rows)
        for k, (row, named_by, reason) in enumerate(bad):
            writer.writerow(row)
            line = f"captions.csv line {len(rows) + k + 2}"  # the header is line 1
            expected[line if named_by == "line" else named_by] = reason
    assert len(bad) == len(rows) // 20
    return csv_path, expected


def _check_summary(out: str, reports: Path) -> None:
    """What `make run` ended with (`sat summary`): a row per model with the scores its
    evaluation recorded, the registered champion, and a caption command for the profile."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model "))
    rows = lines[header + 1 : header + 3]
    assert [row.split()[0] for row in rows] == ["soft", "hard"], out
    for row in rows:
        metrics = json.loads((reports / row.split()[0] / "metrics.json").read_text())
        assert {f"{metrics[k]:.4f}" for k in METRIC_KEYS} <= set(row.split()[1:]), (row, metrics)
    registry = json.loads((reports / "registry.json").read_text())
    champion = f"champion: sat-captioner-mine version {registry['champion']} ("
    assert any(line.startswith(champion) for line in lines[header + 3 :]), out
    assert "sat caption --params profiles/mine/params.yaml " in out, out


def test_a_folder_of_photos_to_a_captioning_champion(tmp_path: Path) -> None:
    project = project_for_make_run(tmp_path / "sat")
    photos = tmp_path / "photos"
    csv_path, expected = _dataset(photos)
    new_profile, make_run = _readme_commands(photos)
    assert make_run == "make run PROFILE=mine"

    made = _bash(project, new_profile)
    assert made.returncode == 0, made.stderr
    assert "make run PROFILE=mine" in made.stdout
    params = project / "profiles" / "mine" / "params.yaml"
    raw = apply_overrides(read_yaml(params.read_text()), TINY)
    params.write_text(yaml.safe_dump(raw, sort_keys=False))

    run = _bash(project, make_run)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    _check_summary(run.stdout, project / "profiles/mine/reports")

    report = json.loads((project / "profiles/mine/data/prepared/prepare_report.json").read_text())
    reasons = {entry["item"]: entry["reason"] for entry in report["skipped"]}
    for item, reason in expected.items():
        assert item in reasons, f"{item} (expected: {reason}) is not in the prepare report"
        assert reason in reasons[item], f"{item}: {reasons[item]!r}, expected {reason!r}"
    assert report["images_ok"] == PHOTOS
    # six each were drawn, among them perhaps a bad row's image
    assert 1 <= report["images_val"] <= 6 and 1 <= report["images_test"] <= 6
    assert report["captions_kept"] == PHOTOS * CAPTIONS_PER_PHOTO

    registry = json.loads((project / "profiles/mine/reports/registry.json").read_text())
    assert registry["model_name"] == "sat-captioner-mine" and registry["champion"] is not None

    first = csv_path.read_text(encoding="utf-8").splitlines()[1].split(",")[0]
    photo = photos / first
    caption = ".venv/bin/sat caption --params profiles/mine/params.yaml --format jsonl"
    captioned = _bash(project, f"{caption} {shlex.quote(str(photo))}")
    assert captioned.returncode == 0, captioned.stderr
    row = json.loads(captioned.stdout.strip().splitlines()[-1])
    assert row["path"] == str(photo) and row["error"] is None
    assert isinstance(row["caption"], str) and row["caption"].split()
