"""A forged version promoted to champion is refused by every command that loads it.

A SQLite store on disk with one honest version; a second version's checkpoint is changed in the
artifact store after it was registered (a vocabulary word swapped: the kind of edit anyone with
write access to the bucket can make), then promoted to ``champion``. Each command a user would
run on the champion is run as the installed ``sat``: each refuses the model with one line and
status 1, and none captions anything with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tracking.model_uri import ModelCheckError, fetch_model
from pipeline.tracking.packaging import log_and_register
from sat_model.paths import shared_data
from tests.factories import write_tiny_model
from tests.pipeline.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]
SAT = Path(sys.executable).with_name("sat")
NAME = "sat-captioner"
WORDS = ("a", "red", "circle")
PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder whose store's champion is a forged version 2."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("forged")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("forged", str(root / "artifacts"))
    for seed in (0, 1):
        registered = log_and_register(
            client,
            model_dir=write_tiny_model(root / f"model{seed}", words=WORDS, resize=72, seed=seed),
            model_name=NAME,
            experiment_id=experiment,
            metrics={"bleu_4": 0.1},
            params={},
            tags={"attention": "soft"},
        )
    (vocab,) = [
        p
        for p in (root / "artifacts").rglob("checkpoint/vocab.json")
        if registered.checkpoint_sha256 in (p.parents[2] / "MLmodel").read_text()
    ]
    vocab.write_text(vocab.read_text().replace("circle", "square"))
    client.set_registered_model_alias(NAME, "champion", registered.version)
    (root / "params.yaml").write_text(f"mlflow: {{tracking_uri: '{uri}'}}\n")
    return root


def _sat(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return subprocess.run(
        [str(SAT), *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _photo() -> Path:
    if not PHOTOS.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({PHOTOS})")
    return sorted(PHOTOS.glob("*.jpg"))[0]


@pytest.mark.parametrize(
    "command",
    [
        ["caption", "{photo}"],
        ["caption", "--engine", "ray", "{folder}", "--out", "{out}"],
        ["evaluate", "--model", f"models:/{NAME}@champion"],
        ["serve", "--port", "{port}"],
        ["serve", "--engine", "ray", "--port", "{port}"],
    ],
    ids=["caption", "caption-ray", "evaluate", "serve", "serve-ray"],
)
def test_every_command_refuses_a_forged_champion(
    forged: Path, tmp_path: Path, command: list[str]
) -> None:
    photo = _photo()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / photo.name).write_bytes(photo.read_bytes())
    fields = {"photo": str(photo), "folder": str(tmp_path / "in"), "out": str(tmp_path / "out")}
    args = [a.format(**fields, port=free_port()) for a in command]
    done = _sat(forged, *args)
    assert done.returncode == 1, (done.stdout[-500:], done.stderr[-2000:])
    # the last line: `sat evaluate` lets MLflow's download progress bar through before it
    line = done.stderr.strip().splitlines()[-1]
    assert f"refusing models:/{NAME}@champion: its checkpoint's sha256" in line, line
    assert "recorded when it was registered" in line and "Traceback" not in done.stderr
    assert not done.stdout.strip() and not (tmp_path / "out").exists()


def test_the_honest_version_still_loads(forged: Path, tmp_path: Path) -> None:
    """The check refuses the forgery, not every model: version 1 fetches with its sha256."""
    uri = f"sqlite:///{forged / 'mlflow.db'}"
    fetched = fetch_model(f"models:/{NAME}/1", tmp_path, uri)
    assert (
        fetched.version == "1" and fetched.sha256 and (fetched.checkpoint / "vocab.json").is_file()
    )
    with pytest.raises(ModelCheckError, match="recorded when it was registered"):
        fetch_model(f"models:/{NAME}/2", tmp_path / "2", uri)
