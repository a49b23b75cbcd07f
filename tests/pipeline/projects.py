"""What tests of whole projects share: the params that make a project tiny, the metric keys a
report holds, which stages a ``dvc repro`` ran (and that one ran none), and what a finished
sweep records."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pipeline.settings import Params, load_params
from pipeline.tracking.runs import PARENT_TAG, connect
from tests.factories import copy_project

METRIC_KEYS = {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor", "rouge_l", "cider"}


# applied to the project's own params.yaml, so every key a stage declares stays present
TINY = [
    "data.synthetic.train_images=24",
    "data.synthetic.val_images=8",
    "data.synthetic.test_images=8",
    "data.vocab.min_count=1",
    "encoder.name=random",
    "encoder.batch_size=8",
    "encoder.num_workers=0",
    "encoder.torch_threads=1",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.attention_dim=16",
    "train.val_images=4",
    "train.soft.max_epochs=1",
    "train.soft.batch_size=16",
    "train.hard.max_epochs=1",
    "train.hard.batch_size=16",
    "eval.beam_size=2",
    "eval.gallery_images=2",
    "ray.num_cpus=2",
    "ray.num_workers=1",
    "ray.cpus_per_worker=1",
]


def project_for_make_run(dest: Path) -> Path:
    """:func:`~tests.factories.copy_project` to ``dest``, where `make run` uses the environment
    running the tests: ``.venv`` links to it and ``pyproject.toml`` is dated before its install,
    so make installs nothing. Skips outside the project's ``.venv`` (make would install one)."""
    venv = Path(sys.prefix)
    if not (venv / ".installed").is_file():
        pytest.skip("tests run outside the project's .venv: make run would install one")
    project = copy_project(dest)
    (project / ".venv").symlink_to(venv)
    os.utime(project / "pyproject.toml", (0, 0))
    return project


def stages_run(output: str) -> set[str]:
    """The stages a ``dvc repro`` says it ran, read from its ``output``."""
    return set(re.findall(r"Running stage '([^']+)'", output))


def recorded_outputs(project: Path, pipeline: str = "dvc.yaml") -> dict[str, dict[str, object]]:
    """Per stage in the pipeline's lock, every file of the outputs it records: (mtime ns, md5)."""
    lock = project / Path(pipeline).with_suffix(".lock")
    spec = yaml.safe_load((project / pipeline).read_text())["stages"]
    found: dict[str, dict[str, object]] = {}
    for name, stage in yaml.safe_load(lock.read_text())["stages"].items():
        base = lock.parent / spec[name.split("@")[0]].get("wdir", ".")  # paths are from wdir
        found[name] = {}
        for out in stage.get("outs", []):
            path = base / out["path"]
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for file in files:
                digest = hashlib.md5(file.read_bytes()).hexdigest()
                found[name][str(file.relative_to(project))] = (file.stat().st_mtime_ns, digest)
    return found


def assert_repro_ran(
    project: Path, repro: Callable[[], str], ran: set[str], pipeline: str = "dvc.yaml"
) -> str:
    """``repro()`` (a ``dvc repro`` or ``dvc exp run`` of ``pipeline`` in ``project``) ran the
    stages ``ran`` and no other, seen three ways: the stages its output names; the files of
    the outputs the lock records, which every stage that ran rewrote (a new mtime at least)
    and every other kept (bytes and mtime); and ``dvc status --json``, which finds the
    pipeline up to date. Returns the output."""
    before = recorded_outputs(project, pipeline)
    output = repro()
    assert stages_run(output) == ran, output
    after = recorded_outputs(project, pipeline)
    assert before.keys() <= after.keys() and any(before.values()), (before.keys(), after.keys())
    for stage, files in before.items():
        if stage in ran:
            assert after[stage] != files, f"{stage} ran, yet its outputs are as they were"
        else:
            assert after[stage] == files, f"{stage} did not run, yet its outputs changed"
    status = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "status", "--json", pipeline],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == {}, status.stdout
    return output


def check_recorded_sweep(project: Path, out: str, trials: int) -> None:
    """What a finished sweep of ``trials`` soft-attention trials leaves in ``project``: the trial
    table in its output ``out``, best_params.yaml, one MLflow parent run and a child per trial,
    and a ``dvc exp run`` line that trains the winner. The sweep itself is run the way the README
    gives it, in tests/pipeline/test_dvc_pipeline.py."""
    best = yaml.safe_load((project / "reports" / "tune" / "best_params.yaml").read_text())
    assert best["metric"] == "val_bleu_4" and best["attention"] == "soft"
    assert set(best["params"]) == {"train.soft.lr", "train.soft.doubly_stochastic"}
    assert f"{best['score']:.4f}" in out
    _check_trial_table(out, trials)
    params = load_params(project / "params.yaml")
    trial_values = _check_parent_and_child_runs(params, project, best, trials)
    # applying the printed `dvc exp run -S ...` line gives that trial's values exactly
    printed = [line for line in out.splitlines() if "dvc exp run" in line]
    assert printed and printed[-1].endswith(best["apply"])
    command = shlex.split(best["apply"])
    assert command[:3] == ["dvc", "exp", "run"]
    flags, overrides = command[3::2], command[4::2]
    assert set(flags) == {"-S"} and len(flags) == len(overrides) == 2
    applied = load_params(project / "params.yaml", overrides)
    assert applied.train.soft.lr == trial_values["train.soft.lr"]
    assert applied.train.soft.doubly_stochastic == trial_values["train.soft.doubly_stochastic"]
    assert applied.train.hard == params.train.hard and applied.model == params.model


def _check_trial_table(out: str, trials: int) -> None:
    """The trial table: a header, then rows of trial, status, epoch, searched values, BLEU-4."""
    table = out.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("trial "))
    assert table[header].split() == [
        "trial",
        "status",
        "epoch",
        "lr",
        "doubly_stochastic",
        "val_bleu_4",
    ]
    rows = [line.split() for line in table[header + 1 :] if len(line.split()) == 6]
    assert sum(row[1] == "done" for row in rows) == trials  # every trial ended, none in error
    assert {row[1] for row in rows} <= {"running", "done"}
    assert all(row[2] in {"1", "2"} for row in rows if row[1] == "running")


def _check_parent_and_child_runs(
    params: Params, project: Path, best: dict, trials: int
) -> dict[str, float]:
    """One parent run, a finished child per trial with its values and curves, and the best
    score one the winner logged; returns the winner's values."""
    tracking = connect(params.mlflow, project)
    client = tracking.client()
    runs = client.search_runs([tracking.experiment_id], "tags.`sat.sweep` = '1'")
    assert len(runs) == 1
    parent = runs[0]
    children = client.search_runs(
        [tracking.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    )
    assert len(children) == trials
    scores = []
    for child in children:
        assert child.info.status == "FINISHED"  # also those Tune stopped (ASHA, max_t)
        assert set(child.data.params) == {"train.soft.lr", "train.soft.doubly_stochastic"}
        lam = float(child.data.params["train.soft.doubly_stochastic"])
        assert 0.0 <= lam <= 2.0
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_bleu_4")]
        assert steps and steps == sorted(set(steps)) and set(steps) <= {1, 2}  # ASHA may stop at 1
        assert client.get_metric_history(child.info.run_id, "val_cider")
        scores += [m.value for m in client.get_metric_history(child.info.run_id, "val_bleu_4")]
    # the best is a score some trial really logged; not necessarily the max of the children's
    # last MLflow values: a trial that ASHA stops can log one more epoch than Tune received
    assert any(best["score"] == pytest.approx(s, rel=1e-9, abs=0.0) for s in scores)
    assert parent.data.metrics["best_val_bleu_4"] == pytest.approx(best["score"])
    # the best is the trial it names: that trial logged the score and the params recorded
    (winner,) = [c for c in children if c.data.tags["sat.trial_id"] == best["trial_id"]]
    history = client.get_metric_history(winner.info.run_id, "val_bleu_4")
    assert best["score"] in [m.value for m in history]
    trial_values = {k: float(v) for k, v in winner.data.params.items()}
    assert best["params"] == trial_values
    return trial_values
