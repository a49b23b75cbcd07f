"""Serving the champion: a real ``mlflow server`` and ``mlflow models serve`` on 127.0.0.1.

A POST to ``/invocations`` with an image (base64 in a ``dataframe_split``) returns its caption;
an input that is not an image is answered with HTTP 400 and a message saying so.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipeline.registry import log_and_register, promote_if_better
from sat_model.checkpoint import save_checkpoint
from sat_model.config import ModelParams
from sat_model.encoders import build_encoder
from sat_model.model import build_model
from sat_model.vocab import Vocab

pytestmark = [pytest.mark.mlflow, pytest.mark.slow]
NAME = "sat-captioner"
WORDS = {"a", "red", "circle"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command: list[str], health_url: str, log: Path, env=None) -> subprocess.Popen:
    process = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:5]} exited {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(health_url, timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    _stop(process)
    raise TimeoutError(f"{health_url} did not answer; log:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    # the serve command runs uvicorn as a child: end the whole session we started
    try:
        os.killpg(process.pid, 15)
        process.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, 9)
        process.wait()


def _save_model(directory: Path) -> Path:
    torch.manual_seed(0)
    vocab = Vocab(("<pad>", "<start>", "<end>", "<unk>", *sorted(WORDS)), 1, 100, 20)
    d = build_encoder("random", input_size=64).description
    model = build_model(
        ModelParams(embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0),
        vocab_size=len(vocab), annotation_dim=d.annotation_dim, num_locations=d.num_locations,
        attention="soft",
    )  # fmt: skip
    with torch.no_grad():
        model.out.bias[:4] = -1e4  # never a special token
    save_checkpoint(
        directory, model_config=model.config, vocab=vocab, model_state=model.state_dict(),
        extra_config={"attention": "soft", "encoder": {**d.to_dict(), "resize": 72}},
    )  # fmt: skip
    return directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Tracking server, one registered champion, and its scoring server; yields its URL."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("serving")
    port = _free_port()
    tracking = f"http://127.0.0.1:{port}"
    server = _start(
        [sys.executable, "-m", "mlflow", "server",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "mlartifacts"),
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        f"{tracking}/health", root / "server.log",
    )  # fmt: skip
    try:
        client = MlflowClient(tracking)
        registered = log_and_register(
            client, model_dir=_save_model(root / "model"), model_name=NAME,
            experiment_id=client.create_experiment("serving"), metrics={"bleu_4": 0.1},
            params={}, tags={"attention": "soft"},
        )  # fmt: skip
        promote_if_better(client, NAME, registered.version, "bleu_4")
        serve_port = _free_port()
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, "MLFLOW_TRACKING_URI": tracking,
               "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}  # fmt: skip
        scoring = _start(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{NAME}@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(serve_port),
             "--workers", "1"],
            f"http://127.0.0.1:{serve_port}/ping", root / "serve.log", env=env,
        )  # fmt: skip
        try:
            yield f"http://127.0.0.1:{serve_port}"
        finally:
            _stop(scoring)
    finally:
        _stop(server)


def _post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/invocations",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _png_base64() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (80, 60), (220, 40, 40)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_invocations_caption_an_image(served):
    status, body = _post(
        served,
        {"dataframe_split": {"columns": ["image"], "data": [[_png_base64()]]},
         "params": {"return_attention": True}},
    )  # fmt: skip
    assert status == 200, body
    (row,) = body["predictions"]
    words = row["caption"].split()
    assert words and set(words) <= WORDS
    attention = json.loads(row["attention"])
    assert attention["words"] == words
    assert len(attention["alphas"]) == len(words)
    assert all(len(a) == 16 and abs(sum(a) - 1) < 1e-3 for a in attention["alphas"])


def test_a_non_image_gets_a_clear_error_response(served):
    bogus = base64.b64encode(b"this is text, not a picture").decode()
    status, body = _post(served, {"dataframe_split": {"columns": ["image"], "data": [[bogus]]}})
    assert status == 400
    assert "not a usable image" in body["message"]
