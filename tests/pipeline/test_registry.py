"""The registry: the promotion rule (table), checkpoint hashing, and register/promote/caption
against a real ``mlflow server`` process on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import (
    CHAMPION_ALIAS,
    checkpoint_sha256,
    decide_promotion,
    list_versions,
    promote,
    promote_if_better,
    promotion_allowed,
)
from tests.factories import write_tiny_model

NAME = "sat-captioner"


@pytest.mark.parametrize(
    ("candidate", "champion", "promote_it"),
    [
        (0.30, 0.20, True),  # better
        (0.10, 0.20, False),  # worse
        (0.20, 0.20, False),  # equal: the incumbent stays
        (0.10, None, True),  # no champion yet
        (None, 0.20, False),  # the candidate has no value
        (math.nan, None, False),  # nor does a NaN
        (0.10, math.nan, True),  # a champion without the metric is beaten by any value
    ],
)
def test_promotion_rule(candidate, champion, promote_it):
    assert decide_promotion(candidate, champion).promote is promote_it


@pytest.mark.parametrize(
    ("policy", "experiment", "allowed"),
    [
        ("auto", None, True),  # `dvc repro`
        ("auto", "lr-try", False),  # `dvc exp run`: the champion stays
        ("always", "lr-try", True),  # asked for
        ("never", None, False),  # only `sat promote`
    ],
)
def test_promotion_policy(policy, experiment, allowed):
    from pipeline.cli.main import build_parser

    ok, reason = promotion_allowed(policy, experiment, "3")
    assert ok is allowed
    if not ok:  # the command the reason gives is one `sat` accepts, naming the version
        command = re.search(r"`(sat promote[^`]*)`", reason)
        assert command is not None, reason
        args = build_parser().parse_args(shlex.split(command[1])[1:])
        assert (args.command, args.version) == ("promote", "3")


def test_checkpoint_hash_follows_the_files_not_the_folder(tmp_path):
    a = write_tiny_model(tmp_path / "a", resize=72, seed=0, real_words_only=False)
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    other = write_tiny_model(tmp_path / "b", resize=72, seed=1, real_words_only=False)
    assert checkpoint_sha256(a) == checkpoint_sha256(copy)
    assert checkpoint_sha256(a) != checkpoint_sha256(other)
    (copy / "vocab.json").write_text((copy / "vocab.json").read_text() + " ")
    assert checkpoint_sha256(a) != checkpoint_sha256(copy)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def start_mlflow_server(root: Path) -> tuple[str, subprocess.Popen]:
    """A real tracking server (SQLite backend, local artifact store) on a free loopback port."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "mlartifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = (root / "server.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{uri}/health", process)
    except BaseException:
        stop(process)
        raise
    return uri, process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    uri, process = start_mlflow_server(root)
    yield uri
    stop(process)


def _register(client, model_dir, bleu_4, experiment_id):
    return log_and_register(
        client,
        model_dir=model_dir,
        model_name=NAME,
        experiment_id=experiment_id,
        metrics={"bleu_4": bleu_4, "cider": 0.5},
        params={"model.embed_dim": "8"},
        tags={"sat.attention": "soft", "mlflow.source.git.commit": "abc"},
        run_name="t",
    )


@pytest.mark.mlflow
@pytest.mark.slow
def test_register_dedup_promote_and_caption_over_http(server, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    client = MlflowClient(server)
    experiment_id = client.create_experiment("sat-test")
    first = _register(
        client,
        write_tiny_model(tmp_path / "m1", resize=72, seed=1, real_words_only=False),
        0.20,
        experiment_id,
    )
    assert (first.version, first.reused) == ("1", False)
    assert promote_if_better(client, NAME, first.version, "bleu_4").promoted  # no champion yet

    # a retry of the same checkpoint (copied elsewhere) reuses version 1
    again = _register(
        client, Path(shutil.copytree(tmp_path / "m1", tmp_path / "m1b")), 0.2, experiment_id
    )
    assert (again.version, again.reused) == ("1", True)

    worse = _register(
        client,
        write_tiny_model(tmp_path / "m2", resize=72, seed=2, real_words_only=False),
        0.10,
        experiment_id,
    )
    kept = promote_if_better(client, NAME, worse.version, "bleu_4")
    assert (kept.promoted, kept.champion) == (False, "1")
    better = _register(
        client,
        write_tiny_model(tmp_path / "m3", resize=72, seed=3, real_words_only=False),
        0.30,
        experiment_id,
    )
    moved = promote_if_better(client, NAME, better.version, "bleu_4")
    assert (moved.promoted, moved.previous_champion, moved.champion) == (True, "1", "3")

    rows = list_versions(client, NAME)
    assert [r.version for r in rows] == ["1", "2", "3"]
    assert [r.aliases for r in rows] == [(), (), (CHAMPION_ALIAS,)]
    assert [r.metrics["bleu_4"] for r in rows] == [0.2, 0.1, 0.3]
    v1 = client.get_model_version(NAME, "1")
    assert v1.tags["sat.attention"] == "soft" and v1.tags["mlflow.source.git.commit"] == "abc"

    assert promote(client, NAME, "bleu_4", version="2").champion == "2"  # the user's choice
    assert promote(client, NAME, "bleu_4").champion == "3"  # the best again

    mlflow.set_tracking_uri(server)
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@{CHAMPION_ALIAS}")
    buffer = io.BytesIO()
    Image.new("RGB", (90, 60), (200, 30, 30)).save(buffer, format="PNG")
    out = model.predict(pd.DataFrame({"image": [buffer.getvalue()]}))
    assert isinstance(out["caption"][0], str)
    assert set(out["caption"][0].split()) <= {"a", "red", "circle", "<unk>"}
    with pytest.raises(MlflowException, match="no usable image in the request"):
        model.predict(pd.DataFrame({"image": ["definitely not an image"]}))


@pytest.mark.mlflow
def test_a_checkpoint_decoded_another_way_is_a_new_version_with_its_own_run(tmp_path):
    # the training run holds the first version's scores; the same checkpoint scored again with
    # another length penalty must not overwrite them: its version gets a run of its own
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    artifacts = (tmp_path / "mlartifacts").as_uri()  # not ./mlruns in the working directory
    experiment_id = client.create_experiment("sat-test", artifact_location=artifacts)
    training_run = client.create_run(experiment_id).info.run_id
    model_dir = write_tiny_model(tmp_path / "m", resize=72)

    def register(length_penalty: float, bleu_4: float):
        return log_and_register(
            client,
            model_dir=model_dir,
            model_name=NAME,
            experiment_id=experiment_id,
            metrics={"bleu_4": bleu_4},
            params={},
            tags={},
            run_name="rescored",
            run_id=training_run,
            decoding={"beam_size": 3, "max_length": 20, "length_penalty": length_penalty},
        )

    first, second = register(1.0, 0.2), register(2.0, 0.3)
    assert (first.version, first.reused, first.run_id) == ("1", False, training_run)
    assert (second.version, second.reused) == ("2", False) and second.run_id != training_run
    assert [r.metrics["bleu_4"] for r in list_versions(client, NAME)] == [0.2, 0.3]
    assert register(2.0, 0.3) == dataclasses.replace(second, reused=True)  # found again
