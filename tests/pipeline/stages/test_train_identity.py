"""A training run is never stale: its identity is everything ``train@<attention>`` depends on.

In a temporary git clone with tiny params, as a DVC user works: ``dvc repro train@soft`` once;
then an uncommitted change of a declared param (the learning rate) and ``dvc repro train@soft``
again: the stage trains new weights from epoch 1 as a new run and MLflow holds a new curve. The
stage run again with nothing changed trains nothing. Which changes make a new identity (a param
that is no hyperparameter, a line of the model's code) test_run_identity.py shows without
training. Real DVC, Ray (one head for the module, joined through ``RAY_ADDRESS`` as ``make
run``'s stages join theirs) and MLflow (SQLite).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.ray.head import ray_head
from pipeline.tracking.registry import checkpoint_sha256
from sat_model.params import apply_overrides, read_yaml
from tests.factories import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.mlflow,
    pytest.mark.java,
    pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java"),
]

# applied to the project's own params.yaml, so every key the stages declare stays present
TINY = [
    "data.synthetic.train_images=16",
    "data.synthetic.val_images=4",
    "data.synthetic.test_images=4",
    "data.vocab.min_count=1",
    "encoder.name=random",
    "encoder.batch_size=8",
    "encoder.num_workers=0",
    "encoder.torch_threads=1",
    "model.embed_dim=8",
    "model.hidden_dim=16",
    "model.attention_dim=8",
    "train.val_images=4",
    "train.soft.max_epochs=2",
    "train.soft.batch_size=16",
    "ray.num_cpus=2",
    "ray.num_workers=1",
    "ray.cpus_per_worker=1",
]
EPOCHS = [1, 2]


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """One loopback Ray head (``pipeline.ray.head``, as ``make run`` starts it) for the module."""
    with ray_head(num_cpus=2) as address:
        yield address


def _env(head: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_ADDRESS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    env.update(RAY_ADDRESS=head, RAY_AUTH_MODE="token")  # `ray start` turns token auth on
    return env


def _run(project: Path, head: str, *cmd: str) -> str:
    out = subprocess.run(
        list(cmd), cwd=project, env=_env(head), capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def _repro_train(project: Path, head: str) -> str:
    return _run(project, head, str(Path(sys.executable).parent / "dvc"), "repro", "train@soft")


def _set_params(project: Path, *overrides: str) -> None:
    path = project / "params.yaml"
    raw = apply_overrides(read_yaml(path.read_text()), list(overrides))
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def _training_runs(project: Path) -> list:
    """MLflow runs of train@soft, oldest first."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sat")
    runs = client.search_runs(
        [experiment.experiment_id], "tags.`sat.attention` = 'soft'", order_by=["start_time ASC"]
    )
    return [(run, client.get_metric_history(run.info.run_id, "train_loss")) for run in runs]


def _curve_epochs(project: Path) -> list[int]:
    text = (project / "models" / "soft" / "curves.csv").read_text().splitlines()
    return [int(line.split(",")[0]) for line in text[1:]]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, head: str) -> Path:
    """A git clone of this repository's HEAD with tiny params, after one `dvc repro train@soft`."""
    path = tmp_path_factory.mktemp("identity") / "sat"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(path)], check=True)
    _set_params(path, *TINY)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "tiny params"], cwd=path, check=True)
    out = _repro_train(path, head)
    assert "train@soft: training from epoch 1" in out, out
    return path


@pytest.fixture(scope="module")
def first_hash(project: Path) -> str:
    """The first run's model hash (weights, config with its identity, vocabulary)."""
    return checkpoint_sha256(project / "models" / "soft")


@pytest.fixture(scope="module")
def first_weights(project: Path) -> dict[str, torch.Tensor]:
    """The first run's trained tensors, as ``model.safetensors`` holds them."""
    return load_file(project / "models" / "soft" / "model.safetensors")


def test_the_stage_run_again_with_nothing_changed_trains_nothing(
    project: Path, head: str, first_hash: str
) -> None:
    runs = _training_runs(project)
    attempts = sorted(p.name for p in (project / "ray_results").iterdir())
    stage = ["-m", "pipeline.stages.train", "--params", "params.yaml", "--attention", "soft"]
    out = _run(project, head, sys.executable, *stage)
    assert re.search(r"train@soft: nothing to train: run sat-soft-\w+-1 of this identity", out)
    assert checkpoint_sha256(project / "models" / "soft") == first_hash
    assert len(_training_runs(project)) == len(runs)
    assert sorted(p.name for p in (project / "ray_results").iterdir()) == attempts


def test_a_param_change_trains_a_new_run_from_epoch_1(
    project: Path, head: str, first_weights: dict[str, torch.Tensor]
) -> None:
    """An uncommitted change of a declared param (the learning rate), then ``dvc repro``.

    The lr changes the weights a run trains, so new weights tell a new run from a stage that
    only rewrote the model's config; test_run_identity.py shows that the identity also changes
    with a declared param that is no hyperparameter and with a line of the model's code.
    """
    before = _training_runs(project)
    _set_params(project, "train.soft.lr=0.003")
    out = _repro_train(project, head)
    assert "Running stage 'train@soft'" in out
    assert "train@soft: training from epoch 1 as run" in out, out
    weights = load_file(project / "models" / "soft" / "model.safetensors")
    assert {k: v.shape for k, v in weights.items()} == {
        k: v.shape for k, v in first_weights.items()
    }
    assert not all(torch.equal(weights[k], first_weights[k]) for k in weights), "not retrained"
    after = _training_runs(project)
    assert len(after) == len(before) + 1  # a new MLflow run ...
    newest, history = after[-1]
    assert sorted(m.step for m in history) == EPOCHS  # ... with a whole new curve
    identities = {run.data.tags["sat.identity"] for run, _ in before}
    assert newest.data.tags["sat.identity"] not in identities
    assert newest.data.params["train.soft.lr"] == "0.003"
    assert _curve_epochs(project) == EPOCHS
    config = json.loads((project / "models" / "soft" / "config.json").read_text())
    assert config["identity"] == newest.data.tags["sat.identity"]
