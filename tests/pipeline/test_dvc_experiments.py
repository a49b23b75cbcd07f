"""`dvc exp run -S` on the project's own params files: DVC writes the whole file back with its
YAML writer, so a file not already in that writer's form would show every experiment as dozens
of changed lines (flow lists turned into block lists, ``null`` into an empty value). In the
form the project keeps them, an experiment's diff is the lines it set.

The experiment runs in a fresh git + DVC repository holding the committed params files and a
one-line stage that reads the keys set, so DVC's own writer, not a copy of it, edits the files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.factories import ROOT

# (params file, key, value): a key of each file, as a user sets it (a profile's: one it sets)
SETS = [
    ("params.yaml", "train.soft.max_epochs", "1"),
    ("profiles/flickr8k/params.yaml", "train.hard.lr", "0.001"),
    ("profiles/coco/params.yaml", "train.val_images", "500"),
    ("profiles/flickr30k/params.yaml", "model.dropout", "0.25"),
]


def _run(cwd: Path, *args: str) -> str:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"] if args[0] == "git" else []
    command = [*git, *args[1:]] if git else [str(Path(sys.executable).parent / args[0]), *args[1:]]
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _changed_lines(diff: str) -> list[str]:
    return [
        line
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="DVC experiments need git")
def test_an_experiments_params_diff_is_the_lines_it_set(tmp_path: Path) -> None:
    for name, _, _ in SETS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    stage = {
        "cmd": f"{Path(sys.executable).name} -c pass",
        "params": [{name: [key]} for name, key, _ in SETS],
    }
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"read": stage}}))
    _run(tmp_path, "git", "init", "-q")
    _run(tmp_path, "dvc", "init", "-q")
    _run(tmp_path, "git", "add", "-A")
    _run(tmp_path, "git", "commit", "-qm", "the project's params files")

    sets = [f"{name}:{key}={value}" for name, key, value in SETS]
    _run(tmp_path, "dvc", "exp", "run", *(a for s in sets for a in ("-S", s)))

    for name, key, value in SETS:
        diff = _run(tmp_path, "git", "diff", "--", name)
        changed = _changed_lines(diff)
        leaf = key.rsplit(".", 1)[-1]
        # one line out, the same line with the new value in
        assert len(changed) == 2, f"{name}: `dvc exp run -S {key}` rewrote more:\n{diff}"
        removed, added = changed
        assert removed.startswith("-") and added.startswith("+"), diff
        assert added.split("#")[0].split() == ["+", f"{leaf}:", value], diff
