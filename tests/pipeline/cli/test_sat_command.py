"""The installed ``sat`` command as a user runs it: a subprocess per call, real Flickr8k photos.

The captioning model is tiny and untrained, over the seeded ``random`` encoder (its captions mean
nothing; one per photo is what is checked). Photos are symlinked from the Flickr8k sample
(``../shared/data/flickr8k-sample`` next to the repository); those tests skip without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from PIL import Image

from pipeline.cli.main import main
from sat_model.paths import shared_data
from tests.factories import ROOT, write_tiny_model
from tests.pipeline.servers import free_port

PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
SAT = Path(sys.executable).parent / "sat"
PARAMS = "encoder: {name: random, resize: 72, crop: 64}\neval: {beam_size: 2, max_length: 4}\n"

needs_photos = pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"no Flickr8k sample at {PHOTOS}")
needs_sat = pytest.mark.skipif(not SAT.exists(), reason=f"no sat command next to {sys.executable}")
pytestmark = [needs_sat, pytest.mark.slow]  # a subprocess per command, as a user runs it


def _sat(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run(
        [str(SAT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _photos(n: int) -> list[Path]:
    return sorted(PHOTOS.glob("*.jpg"))[:n]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with params.yaml and a tiny soft model in models/soft (no MLflow store)."""
    root = tmp_path_factory.mktemp("sat_command")
    write_tiny_model(root / "models" / "soft", words=("a", "dog", "runs"), resize=72)
    (root / "params.yaml").write_text(PARAMS)
    return root


def _jsonl(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


@needs_photos
def test_caption_a_folder_as_jsonl_writes_one_line_per_photo(workdir, tmp_path):
    photos = _photos(7)
    folder = tmp_path / "photos"
    (folder / "nested").mkdir(parents=True)
    for i, photo in enumerate(photos):  # recursion: some photos one folder down
        (folder / ("nested" if i % 2 else ".") / photo.name).symlink_to(photo)
    args = ["caption", str(folder), "--format", "jsonl", "--model", "models/soft"]
    done = _sat(*args, "--batch-size", "3", cwd=workdir)
    assert done.returncode == 0, done.stderr
    rows = _jsonl(done.stdout)
    assert sorted(Path(r["path"]).name for r in rows) == [p.name for p in photos]
    for row in rows:
        assert row["error"] is None
        assert len(str(row["caption"]).split()) == 4  # max_length words of the tiny vocabulary
    assert done.stderr == ""  # quiet: no warnings, no progress bar on a pipe


@needs_photos
def test_caption_keeps_going_past_a_corrupt_file_and_skips_non_images(workdir, tmp_path):
    good = _photos(2)
    for photo in good:
        (tmp_path / photo.name).symlink_to(photo)
    (tmp_path / "corrupt.jpg").write_bytes(good[0].read_bytes()[:2000])  # truncated JPEG
    (tmp_path / "notes.jpg").write_text("a text file named like a photo")
    (tmp_path / "README.txt").write_text("not an image extension: never read")
    args = ["caption", str(tmp_path), "--model", "models/soft"]
    done = _sat(*args, "--format", "jsonl", cwd=workdir)
    assert done.returncode == 0, done.stderr
    rows = {Path(str(r["path"])).name: r for r in _jsonl(done.stdout)}
    assert set(rows) == {good[0].name, good[1].name, "corrupt.jpg", "notes.jpg"}
    for name in ("corrupt.jpg", "notes.jpg"):
        assert rows[name]["caption"] is None
        assert str(rows[name]["error"]).startswith("cannot decode")
    assert all(rows[p.name]["caption"] and rows[p.name]["error"] is None for p in good)

    text = _sat(*args, cwd=workdir)
    assert text.returncode == 0
    assert sorted(line.split(": ")[0] for line in text.stdout.splitlines()) == sorted(
        str(tmp_path / p.name) for p in good
    )
    assert f"{tmp_path / 'corrupt.jpg'}: error: cannot decode" in text.stderr


@needs_photos
def test_caption_without_a_champion_says_what_to_do_in_one_line(tmp_path):
    done = _sat("caption", str(_photos(1)[0]), cwd=tmp_path)  # no params.yaml, no mlflow.db
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat caption: error: no champion model registered")
    assert "make run" in line and "--model models/soft" in line
    assert done.stdout == ""
    assert not (tmp_path / "mlflow.db").exists()  # looking for it created no store


def test_caption_of_a_folder_that_is_no_model_is_one_line(workdir, tmp_path):
    image = tmp_path / "x.png"
    Image.new("RGB", (80, 60)).save(image)
    done = _sat("caption", str(image), "--model", "models/absent", cwd=workdir)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "sat caption: error: models/absent is not a model folder (no model.safetensors in it)"
    ]


def test_a_bad_param_is_one_line_and_minus_v_shows_the_traceback(workdir):
    done = _sat("train", "--attention", "soft", "-S", "train.soft.lr=abc", cwd=workdir)
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat train: error: invalid params:") and "train.soft.lr" in line
    assert "Traceback" not in done.stderr

    verbose = _sat("-v", "train", "--attention", "soft", "-S", "train.soft.lr=abc", cwd=workdir)
    assert verbose.returncode != 0
    assert "Traceback (most recent call last)" in verbose.stderr
    assert "ParamsError" in verbose.stderr and "train.soft.lr" in verbose.stderr


def test_version_is_the_installed_distribution_version(tmp_path):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = _sat("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"sat {declared}"


def test_a_missing_params_file_is_one_line_for_every_command_that_reads_params(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # in process: the same main() as the command, without 3 starts
    for command in (["train", "--attention", "hard"], ["tune"], ["evaluate"]):
        assert main([*command, "--params", "absent.yaml"]) == 1, command
        assert capsys.readouterr().err.splitlines() == [
            f"sat {command[0]}: error: params file not found: absent.yaml"
        ]


# ------------------------------------------------------------ one convention for every command
# the commands a user has, as the README's table of the `sat` command lists them
COMMANDS = {"caption", "models", "promote", "evaluate", "train", "tune", "summary", "serve"}
COMMANDS |= {"profile"}  # README, "Your own data"
COMMANDS |= {"card", "review"}  # docs/guide/governance.md


def _listed_commands(help_text: str) -> set[str]:
    """The subcommands ``sat --help`` lists (an indented name, then its one-line summary)."""
    return set(re.findall(r"^ {4}([a-z]+) {2,}\S", help_text, flags=re.MULTILINE))


def _entries_without_help(help_text: str) -> list[str]:
    """Arguments of a ``--help`` text that carry no help: an entry line (two spaces, then the
    argument) with nothing after it and no deeper-indented text on the next line."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not re.match(r"^ {2}\S", line) or line.strip().startswith("sat "):  # an example
            continue
        follows = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.search(r"\S {2,}\S", line.strip()) and not re.match(r"^ {6,}\S", follows):
            bare.append(line.strip())
    return bare


def test_every_command_says_what_it_does_with_an_example_in_its_help(tmp_path):
    listed = _sat("--help", cwd=tmp_path)
    assert listed.returncode == 0
    assert _listed_commands(listed.stdout) == COMMANDS
    for command in [*sorted(COMMANDS), "profile new"]:
        done = _sat(*command.split(), "--help", cwd=tmp_path)
        assert done.returncode == 0, command
        usage, _, rest = done.stdout.partition("\n\n")
        description = rest.split("\n\n", 1)[0]
        assert usage.startswith(f"usage: sat {command}")
        # a sentence about the command, not straight into the argument list
        assert not description.endswith(":") and len(description.split()) >= 8, command
        examples = done.stdout.split("\nexamples:\n", 1)[1].splitlines()
        assert examples and all(e.startswith(f"  sat {command}") for e in examples), command
        section = done.stdout.split("\nexamples:\n", 1)[0]
        assert _entries_without_help(section) == [], command


ERRORS = [
    # (arguments, the line's start): each run in an empty folder, outside any project
    (["models"], "sat models: error: no MLflow store at "),
    (["promote", "--metric", "cider"], "sat promote: error: no MLflow store at "),
    (["card"], "sat card: error: no MLflow store at "),
    # a review captions the project's test photos: outside a project there are none
    (["review", "2", "--out", "r"], "sat review: error: params file not found: params.yaml"),
    (["summary"], "sat summary: error: no metrics under reports/"),
    # the missing photo is the first cause, before the missing champion
    (["caption", "nothere.jpg"], "sat caption: error: no such file or folder: nothere.jpg"),
    (["serve", "--port", "FREE"], "sat serve: error: cannot load models:/sat-captioner@champion"),
    (["train"], "sat train: error: the following arguments are required: --attention"),
    (["caption", "x.jpg", "--format", "xml"], "sat caption: error: argument --format: "),
    (["profile", "new", "mine"], "sat profile: error: the following arguments are required"),
    (["captions", "x.jpg"], "sat: error: argument COMMAND: invalid choice: 'captions'"),
]


@pytest.mark.parametrize(("args", "start"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_a_user_error_is_one_line_on_stderr_with_status_1_and_leaves_nothing(tmp_path, args, start):
    done = _sat(*(str(free_port()) if a == "FREE" else a for a in args), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(start), line
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no folder: reading created nothing


def test_caption_on_ray_refuses_an_out_folder_that_holds_an_earlier_run(tmp_path):
    """Ray Data appends: a second run into the same --out would double its rows."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "earlier.json").write_text("{}\n")
    done = _sat("caption", "in", "--engine", "ray", "--out", "out", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line == (
        f"sat caption: error: refusing to write captions into {tmp_path / 'out'}: it holds other "
        "files (earlier.json, ...); name a new folder or prefix with --out"
    )
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["earlier.json"]


def test_booleans_are_read_as_people_write_them(tmp_path):
    (tmp_path / "params.yaml").write_text("encoder: {keep_aspect: Yes}\n")
    done = _sat("models", "-S", "ray.use_gpu=true", "-S", "model.gate=Off", cwd=tmp_path)
    # accepted: the command goes on to its next question, the (absent) tracking store
    assert done.stderr.startswith("sat models: error: no MLflow store at "), done.stderr
    done = _sat("models", "-S", "ray.use_gpu=maybe", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("sat models: error: invalid params: ray.use_gpu: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@needs_photos
def test_a_photo_captioned_by_a_model_of_the_scenes_comes_with_what_it_knows(tmp_path):
    write_tiny_model(tmp_path / "scenes", resize=72, data_source="synthetic")
    write_tiny_model(tmp_path / "photos", resize=72, data_source="flickr8k")
    (tmp_path / "params.yaml").write_text(PARAMS)
    photo = str(_photos(1)[0])
    done = _sat("caption", photo, "--model", "scenes", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith(f"{photo}: ")
    (line,) = done.stderr.splitlines()
    assert line.startswith("sat caption: note: trained on the generated scenes")
    assert "make run PROFILE=flickr8k" in line
    done = _sat("caption", photo, "--model", "photos", "--format", "jsonl", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""  # a model of photos needs no notice


def test_the_command_line_starts_without_torch_ray_or_mlflow() -> None:
    """`sat --help` and every usage error come before any heavy import: the parser and the
    commands' modules import PyTorch, Ray and MLflow only where a command runs."""
    heavy = "{'torch', 'ray', 'mlflow'}"
    code = f"import sys, pipeline.cli.main; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
