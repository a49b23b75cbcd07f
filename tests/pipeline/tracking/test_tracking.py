"""MLflow tracking: URI resolution, run reuse, once-per-epoch metrics, lineage tags, retries."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

from pipeline.settings import MlflowConfig
from pipeline.tracking.lineage import dvc_experiment, lineage_tags
from pipeline.tracking.runs import PARENT_TAG, Tracking, connect, flatten, with_retries
from pipeline.tracking.store import artifact_location, resolve_tracking_uri


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Tracking:
    root = tmp_path_factory.mktemp("project")
    return connect(MlflowConfig(tracking_uri=f"sqlite:///{root / 'mlflow.db'}"), root)


def test_default_tracking_uri_is_an_absolute_sqlite_file_in_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = resolve_tracking_uri(MlflowConfig(), tmp_path)
    assert uri == "sqlite:///" + str(tmp_path.resolve() / "mlflow.db")
    assert uri.startswith("sqlite:////")  # absolute: Ray workers run in another cwd


def test_tracking_uri_env_overrides_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    cfg = MlflowConfig(tracking_uri="sqlite:////elsewhere.db")
    assert resolve_tracking_uri(cfg, tmp_path) == "http://127.0.0.1:5999"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri(cfg, tmp_path) == "sqlite:////elsewhere.db"


def test_artifact_location_is_an_absolute_uri_under_the_project(tmp_path: Path) -> None:
    assert artifact_location(MlflowConfig(), tmp_path) == (tmp_path / "mlartifacts").as_uri()


@pytest.mark.mlflow
def test_new_experiment_puts_artifacts_under_the_project(tmp_path: Path) -> None:
    t = connect(MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"), tmp_path)
    exp = t.client().get_experiment(t.experiment_id)
    assert exp.name == "sat"
    assert exp.artifact_location == (tmp_path / "mlartifacts").as_uri()


@pytest.mark.mlflow
def test_same_run_name_resumes_the_same_run(tracking: Tracking) -> None:
    first = tracking.start_run("sat-soft-abc", tags={"sat.attention": "soft"})
    again = tracking.start_run("sat-soft-abc")
    other = tracking.start_run("sat-soft-def")
    assert first == again != other
    assert tracking.client().get_run(first.run_id).data.tags["sat.attention"] == "soft"


@pytest.mark.mlflow
def test_child_runs_record_their_parent_and_end_as_told(tracking: Tracking) -> None:
    parent = tracking.start_run("sweep")
    done = tracking.start_run("trial-0", tags={"sat.trial_id": "0"}, parent=parent)
    failed = tracking.start_run("trial-1", tags={"sat.trial_id": "1"}, parent=parent)
    tracking.start_run("trial-0", parent=tracking.start_run("another sweep"))
    assert tracking.client().get_run(done.run_id).data.tags[PARENT_TAG] == parent.run_id
    children = {tags["sat.trial_id"]: child for child, tags in parent.children()}
    assert children == {"0": done, "1": failed}
    done.finish()
    failed.fail()
    status = {r.run_id: tracking.client().get_run(r.run_id).info.status for r in (done, failed)}
    assert status == {done.run_id: "FINISHED", failed.run_id: "FAILED"}


@pytest.mark.mlflow
def test_epochs_are_logged_once_across_restarts(tracking: Tracking) -> None:
    run = tracking.start_run("restarts")
    first = run.epochs()
    first.log_epoch(1, {"loss": 3.0, "bleu_4": 0.1})
    first.log_epoch(2, {"loss": 2.0, "bleu_4": 0.2})
    # a restarted worker replays epoch 2 (it died before its checkpoint) and goes on
    second = run.epochs()
    assert second.log_epoch(2, {"loss": 9.0, "bleu_4": 0.9}) == {}
    assert second.log_epoch(3, {"loss": 1.0, "bleu_4": 0.3}) == {"loss": 1.0, "bleu_4": 0.3}
    history = tracking.client().get_metric_history(run.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 2.0), (3, 1.0)]


@pytest.mark.mlflow
def test_log_params_keeps_the_first_value_and_adds_new_keys(tracking: Tracking) -> None:
    run = tracking.start_run("params")
    run.log_params({"lr": "0.001"})
    run.log_params({"lr": "0.001", "epochs": "3"})  # a resumed worker re-logs
    run.log_metric("best_val_bleu_4", 0.25)
    logged = tracking.client().get_run(run.run_id).data
    assert logged.params == {"lr": "0.001", "epochs": "3"}
    assert logged.metrics == {"best_val_bleu_4": 0.25}


def test_flatten_joins_nested_keys_with_dots() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": "x"}) == {
        "a.b": "1",
        "a.c.d": "None",
        "e": "x",
    }


def _git(cwd: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    out.check_returncode()
    return out.stdout.strip()


def test_lineage_tags_hold_the_commit_and_dvc_lock_hashes(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\n"
        "stages:\n"
        "  prepare:\n"
        "    cmd: python -m pipeline.stages.prepare\n"
        "    outs:\n"
        "    - path: data/prepared\n"
        "      hash: md5\n"
        "      md5: 1111aaaa.dir\n"
        "  extract:\n"
        "    cmd: python -m pipeline.stages.extract\n"
        "    outs:\n"
        "    - path: data/features\n"
        "      hash: md5\n"
        "      md5: 2222bbbb.dir\n"
    )
    _git(tmp_path, "add", "dvc.lock")
    _git(tmp_path, "commit", "-q", "-m", "lock")
    head = (tmp_path / ".git" / _git(tmp_path, "symbolic-ref", "HEAD")).read_text().strip()
    assert lineage_tags(tmp_path) == {
        "mlflow.source.git.commit": head,
        "sat.prepared_md5": "1111aaaa.dir",
        "sat.features_md5": "2222bbbb.dir",
    }


def test_lineage_tags_leave_out_what_is_missing(tmp_path: Path) -> None:
    tags = lineage_tags(tmp_path / "not-a-repo-and-no-lock")
    assert tags == {}


def test_with_retries_retries_transient_errors_then_succeeds() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        return "ok"

    assert with_retries(flaky, retries=3, what="flaky", delay_s=0.0) == "ok"
    assert len(calls) == 3


def test_with_retries_raises_a_permanent_error_at_once() -> None:
    calls = []

    def bad() -> None:
        calls.append(1)
        raise MlflowException("no such run", error_code=RESOURCE_DOES_NOT_EXIST)

    with pytest.raises(MlflowException, match="no such run"):
        with_retries(bad, retries=3, what="bad", delay_s=0.0)
    assert len(calls) == 1


def test_with_retries_gives_up_after_the_retry_budget() -> None:
    calls = []

    def down() -> None:
        calls.append(1)
        raise ConnectionError("tracking server down")

    with pytest.raises(ConnectionError):
        with_retries(down, retries=2, what="down", delay_s=0.0)
    assert len(calls) == 3


def test_artifact_location_is_the_servers_own_on_a_tracking_server(tmp_path: Path) -> None:
    # a client's folder is nowhere a teammate can read: the server proxies to its destination
    assert artifact_location(MlflowConfig(), tmp_path, "http://127.0.0.1:5999") is None
    s3 = MlflowConfig(artifact_root="s3://bucket/sat")
    assert artifact_location(s3, tmp_path, "https://mlflow.example") == "s3://bucket/sat"
    local = artifact_location(MlflowConfig(), tmp_path, f"sqlite:///{tmp_path / 'm.db'}")
    assert local == (tmp_path / "mlartifacts").as_uri()


def test_dvc_experiment_is_read_from_what_dvc_exp_run_sets() -> None:
    # dvc/repo/experiments/queue/base.py gives every stage of `dvc exp run` both variables
    assert dvc_experiment({"DVC_EXP_BASELINE_REV": "abc123", "DVC_EXP_NAME": "lr-try"}) == "lr-try"
    assert dvc_experiment({"DVC_ROOT": "/p", "DVC_STAGE": "register"}) is None  # `dvc repro`
    assert dvc_experiment({}) is None
