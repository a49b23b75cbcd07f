"""The pipeline against the store a team uses: ``mlflow server`` on PostgreSQL with its
artifacts proxied to an S3-compatible object store, configured only by ``MLFLOW_TRACKING_URI``.

One set of servers and one `dvc repro` per module (a git clone of HEAD with tiny params): the
stages reach the server over HTTP alone (no S3 credentials in their environment), the champion
loads in a second process, and from the champion one walks to its training run's curves, test
metrics, artifacts and dataset inputs. Then a real `dvc exp run` of a soft-model param (the
learning rate, an uncommitted change) re-runs only the soft branch: the train stage trains new
weights from epoch 1 as a new run of a new identity with a whole new curve, which shows in `dvc
metrics` and `dvc exp show` and registers a version without moving the champion; the train stage
run again with nothing changed trains nothing. Which changes make a new identity (a param that is
no hyperparameter, a line of the model's code) test_run_identity.py shows without training. Every
server is stopped by its PID (tests/pipeline/servers.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.tracking.registry import checkpoint_sha256
from sat_model.data.vocab import load_vocab
from sat_model.params import apply_overrides, read_yaml
from tests.factories import ROOT
from tests.pipeline.projects import METRIC_KEYS, TINY, assert_repro_ran
from tests.pipeline.servers import S3Server, mlflow_server, postgres_server, s3_server

NAME = "sat-captioner"
BUCKET = "sat-mlflow"
ADMIN = ("sat-admin", "team-admin-pw")  # the one account that registers (README, team recipe)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.mlflow,
    pytest.mark.java,
    pytest.mark.skipif(shutil.which("java") is None, reason="METEOR and PTB need Java"),
]


@dataclass(frozen=True)
class Team:
    url: str  # the tracking URI, the only setting the pipeline gets
    s3: S3Server
    postgres_uri: str  # for checking what the backend store holds
    project: Path


def _env(url: str) -> dict[str, str]:
    """The stages' environment: the tracking URI, and no object-store credentials at all."""
    drop = ("MLFLOW_", "RAY_ADDRESS", "AWS_", "DVC_EXP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    env["MLFLOW_TRACKING_URI"] = url
    env.update(MLFLOW_TRACKING_USERNAME=ADMIN[0], MLFLOW_TRACKING_PASSWORD=ADMIN[1])
    return env


def run(team: Team, *cmd: str) -> str:
    out = subprocess.run(
        list(cmd),
        cwd=team.project,
        env=_env(team.url),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def _clone(tmp: Path) -> Path:
    path = tmp / "sat"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(path)], check=True)
    raw = read_yaml((path / "params.yaml").read_text())
    (path / "params.yaml").write_text(yaml.safe_dump(apply_overrides(raw, TINY), sort_keys=False))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "tiny params"], cwd=path, check=True)
    return path


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    """PostgreSQL + S3 store + `mlflow server` on both, and one `dvc repro` through them."""
    tmp = tmp_path_factory.mktemp("team")
    with ExitStack() as stack:
        s3 = stack.enter_context(s3_server(tmp))
        s3.create_bucket(BUCKET)
        pg = stack.enter_context(postgres_server(tmp, databases=("mlflow",)))
        url = stack.enter_context(
            mlflow_server(tmp, pg.uri("mlflow"), f"s3://{BUCKET}/artifacts", s3.env, ADMIN)
        )
        env = stack.enter_context(pytest.MonkeyPatch.context())  # this process's clients
        env.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
        env.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
        team = Team(url, s3, pg.uri("mlflow", driver="postgresql"), _clone(tmp))
        dvc = str(Path(sys.executable).parent / "dvc")
        (team.project / "repro.log").write_text(run(team, dvc, "repro"))
        yield team


def _sql(team: Team, query: str) -> list[tuple]:
    import psycopg

    with psycopg.connect(team.postgres_uri) as conn:
        return conn.execute(query).fetchall()


def test_repro_on_postgres_and_s3_keeps_nothing_local(team: Team) -> None:
    registry = json.loads((team.project / "reports/registry.json").read_text())
    assert {v["attention"] for v in registry["versions"]} == {"soft", "hard"}
    assert registry["champion"] is not None
    # the backend store is the PostgreSQL database; the artifacts are objects in the bucket
    assert _sql(team, "SELECT count(*) FROM model_versions") == [(2,)]
    keys = [
        o["Key"]
        for page in team.s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        for o in page.get("Contents", [])
    ]
    for name in ("MLmodel", "model.safetensors", "captions.json", "curves.csv", "index.html"):
        assert any(k.endswith("/" + name) for k in keys), f"no {name} in the bucket"
    assert not (team.project / "mlflow.db").exists()
    assert not (team.project / "mlartifacts").exists()


def _caption_in_a_second_process(team: Team, image: Path) -> dict:
    script = (
        "import json, sys, pandas as pd, mlflow\n"
        f"model = mlflow.pyfunc.load_model('models:/{NAME}@champion')\n"
        "out = model.predict(pd.DataFrame({'image': [open(sys.argv[1], 'rb').read()]}))\n"
        "print('CAPTION', json.dumps({'caption': out['caption'][0],"
        " 'error': out.get('error', [None])[0]}))\n"
    )
    out = run(team, sys.executable, "-c", script, str(image))
    line = next(x for x in out.splitlines() if x.startswith("CAPTION "))  # stderr follows stdout
    return json.loads(line.removeprefix("CAPTION "))


def _a_test_image(project: Path) -> Path:
    from sat_model.evaluation.evaluate import read_image_records

    prepared = project / "data/prepared"  # the generated scenes live in <prepared_dir>/images
    records = read_image_records(prepared / "images.parquet", "test", prepared / "images")
    return next(r.path for r in records.values() if not r.refused)


def test_only_the_registering_account_moves_the_champion(team: Team) -> None:
    # authentication is on: no account, no answer; a reader reads but cannot register or promote
    import urllib.error
    import urllib.request

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

    search = f"{team.url}/api/2.0/mlflow/registered-models/search"
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(search, timeout=30)
    assert anonymous.value.code == 401
    AuthServiceClient(team.url).create_user("reader", "reader-password-12")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_USERNAME", "reader")
        env.setenv("MLFLOW_TRACKING_PASSWORD", "reader-password-12")
        reader = MlflowClient(team.url)
        champion = reader.get_model_version_by_alias(NAME, "champion")
        with pytest.raises(MlflowException, match="Permission denied"):
            reader.set_registered_model_alias(NAME, "champion", champion.version)
        with pytest.raises(MlflowException, match="Permission denied"):
            reader.create_model_version(NAME, champion.source, champion.run_id)


def test_promote_then_load_the_champion_from_a_second_process(team: Team) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(team.url)
    before = client.get_model_version_by_alias(NAME, "champion").version
    other = next(
        v.version for v in client.search_model_versions(f"name='{NAME}'") if v.version != before
    )
    run(team, str(Path(sys.executable).parent / "sat"), "promote", "--version", str(other))
    assert client.get_model_version_by_alias(NAME, "champion").version == other

    out = _caption_in_a_second_process(team, _a_test_image(team.project))
    assert out["error"] is None
    words = set(load_vocab(team.project / "data/prepared/vocab.json").itos)
    assert out["caption"] and set(out["caption"].split()) <= words


def test_from_the_champion_to_its_training_run(team: Team) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(team.url)
    version = client.get_model_version_by_alias(NAME, "champion")
    attention = version.tags["sat.attention"]
    training = client.get_run(version.run_id)  # the version's run IS the training run
    assert training.data.tags["sat.attention"] == attention
    assert training.data.tags["sat.checkpoint_sha256"] == version.tags["sat.checkpoint_sha256"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=team.project, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert training.data.tags["mlflow.source.git.commit"] == head
    assert training.data.params[f"train.{attention}.max_epochs"] == "1"

    # curves: one point per epoch (step = epoch), the same numbers the train stage wrote to
    # curves.csv, by another path (MLflow from the Ray worker, the CSV from the model writer)
    curves = pd.read_csv(team.project / f"models/{attention}/curves.csv")
    for key in ("train_loss", "val_bleu_4"):
        history = client.get_metric_history(training.info.run_id, key)
        assert [m.step for m in history] == curves["epoch"].tolist()
        assert [m.value for m in history] == pytest.approx(curves[key].tolist())
    # test metrics: evaluate's metrics.json, logged onto the same run
    report = json.loads((team.project / f"reports/{attention}/metrics.json").read_text())
    for key in ("bleu_4", "cider", "meteor"):
        assert training.data.metrics[key] == pytest.approx(report[key])
    artifacts = {a.path for a in client.list_artifacts(training.info.run_id, "evaluation")}
    artifacts |= {a.path for a in client.list_artifacts(training.info.run_id, "training")}
    assert artifacts >= {
        "evaluation/captions.json",
        "evaluation/metrics.json",
        "evaluation/attention",
        "training/curves.csv",
    }

    lock = yaml.safe_load((team.project / "dvc.lock").read_text())["stages"]
    expected = {
        "prepared": lock["prepare"]["outs"][0]["md5"],
        "features": lock["extract"]["outs"][0]["md5"],
    }
    inputs = {d.dataset.name: d.dataset.digest for d in training.inputs.dataset_inputs}
    assert inputs == expected


def _soft_training_runs(client: Any) -> list:
    """The MLflow runs of train@soft, oldest first."""
    experiment = client.get_experiment_by_name("sat")
    return client.search_runs(
        [experiment.experiment_id], "tags.`sat.attention` = 'soft'", order_by=["start_time ASC"]
    )


def _check_a_new_run_from_epoch_1(
    team: Team, client: Any, before: list, first_weights: dict[str, torch.Tensor], out: str
) -> None:
    """The lr changes the weights a run trains, so new weights tell a new run from a stage that
    only rewrote the model's config (or resumed the finished run of the old identity)."""
    assert "train@soft: training from epoch 1 as run" in out, out
    soft = team.project / "models" / "soft"
    weights = load_file(soft / "model.safetensors")
    assert {k: v.shape for k, v in weights.items()} == {
        k: v.shape for k, v in first_weights.items()
    }
    assert not all(torch.equal(weights[k], first_weights[k]) for k in weights), "not retrained"
    after = _soft_training_runs(client)
    assert len(after) == len(before) + 1  # a new MLflow run ...
    newest = after[-1]
    history = client.get_metric_history(newest.info.run_id, "train_loss")
    epochs = pd.read_csv(soft / "curves.csv")["epoch"].tolist()
    assert sorted(m.step for m in history) == epochs == [1]  # ... with a whole new curve
    assert newest.data.tags["sat.identity"] not in {r.data.tags["sat.identity"] for r in before}
    assert newest.data.params["train.soft.lr"] == "0.02"
    config = json.loads((soft / "config.json").read_text())
    assert config["identity"] == newest.data.tags["sat.identity"]


def _check_the_stage_again_trains_nothing(team: Team, client: Any) -> None:
    soft = team.project / "models" / "soft"
    runs, model = len(_soft_training_runs(client)), checkpoint_sha256(soft)
    attempts = sorted(p.name for p in (team.project / "ray_results").iterdir())
    stage = ["-m", "pipeline.stages.train", "--params", "params.yaml", "--attention", "soft"]
    out = run(team, sys.executable, *stage)
    assert re.search(r"train@soft: nothing to train: run sat-soft-\w+-1 of this identity", out)
    assert checkpoint_sha256(soft) == model
    assert len(_soft_training_runs(client)) == runs
    assert sorted(p.name for p in (team.project / "ray_results").iterdir()) == attempts


def test_exp_run_registers_without_moving_the_champion(team: Team) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(team.url)
    # no champion at all: a `dvc repro` register would now promote any version it registers
    client.delete_registered_model_alias(NAME, "champion")
    dvc = str(Path(sys.executable).parent / "dvc")
    runs = _soft_training_runs(client)
    first_weights = load_file(team.project / "models" / "soft" / "model.safetensors")
    # a soft-model param: only the soft branch and register run again
    out = assert_repro_ran(
        team.project,
        lambda: run(team, dvc, "exp", "run", "-n", "lr-try", "-S", "train.soft.lr=0.02"),
        ran={"train@soft", "evaluate@soft", "register"},
    )
    assert "experiment" in out.lower()
    _check_a_new_run_from_epoch_1(team, client, runs, first_weights, out)
    _check_the_stage_again_trains_nothing(team, client)
    shown = json.loads(run(team, dvc, "metrics", "show", "--json"))
    workspace = next(iter(shown.values()))["data"]
    for attention in ("soft", "hard"):
        assert workspace[f"reports/{attention}/metrics.json"]["data"].keys() >= METRIC_KEYS
    diff = run(team, dvc, "metrics", "diff", "HEAD", "--all")
    assert all(key in diff for key in METRIC_KEYS), diff
    shown_exps = run(team, dvc, "exp", "show", "--no-pager", "--csv")
    assert "lr-try" in shown_exps and "train.soft.lr" in shown_exps

    versions = sorted(client.search_model_versions(f"name='{NAME}'"), key=lambda v: int(v.version))
    assert len(versions) == 3
    new = versions[-1]
    assert new.tags["sat.dvc_experiment"] == "lr-try"
    assert new.tags["sat.attention"] == "soft"
    assert client.get_metric_history(new.run_id, "train_loss")  # its run is a training run
    assert client.get_registered_model(NAME).aliases == {}
    registry = json.loads((team.project / "reports/registry.json").read_text())
    assert registry["champion"] is None and registry["dvc_experiment"] == "lr-try"
    assert not any(p["promoted"] for p in registry["promotions"])

    # promotion stays possible, and explicit
    run(team, str(Path(sys.executable).parent / "sat"), "promote", "--version", new.version)
    assert client.get_model_version_by_alias(NAME, "champion").version == new.version
