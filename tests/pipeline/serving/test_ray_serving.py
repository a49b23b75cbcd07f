"""``sat serve --engine ray --address``: the champion on Ray Serve on a shared cluster, over HTTP.

One module-scoped server: a SQLite store with two registered versions of a tiny model, a Ray
head (``ray start``, 127.0.0.1) that already runs another user's Serve application, and
``sat serve --engine ray --address <head>`` on a free 127.0.0.1 port, stopped by its process
group. Clients send real Flickr8k-sample JPEGs as base64 in JSON, as they do to ``sat serve``.
The last test stops the server and finds the other application still serving. ``sat serve
--engine ray`` on a local Ray of its own is walked by test_drift_everywhere,
test_one_caption_everywhere and test_serving_limits.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import promote_if_better
from sat_model.captioner import Captioner
from sat_model.paths import shared_data
from tests.factories import bmp_bomb, png_bomb, write_tiny_model
from tests.pipeline.ray_cluster import RayNodes, ray_nodes
from tests.pipeline.servers import SatServe, free_port, sat_serve

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.mlflow]
SAT = Path(sys.executable).with_name("sat")
NAME = "sat-captioner"
WORDS = ("a", "red", "circle", "dog", "runs")
DECODING = {"beam_size": 2, "max_length": 5}
PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
PARAMS = """\
mlflow: {{tracking_uri: '{uri}'}}
serve:
  max_request_bytes: 2000000
  ray: {{reload_interval_s: 1, max_batch_size: 8, batch_wait_timeout_s: 0.05}}
"""


@dataclass(frozen=True)
class RayServed:
    server: SatServe  # ``sat serve --engine ray --address``
    root: Path
    uri: str  # the tracking store
    models: dict[str, Path]  # version -> its checkpoint folder
    nodes: RayNodes  # the shared cluster
    env: dict[str, str]
    neighbour: str  # the other application's URL

    @property
    def url(self) -> str:
        return self.server.url


def _photos(n: int) -> list[Path]:
    if not PHOTOS.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({PHOTOS})")
    found = [p for p in sorted(PHOTOS.glob("*.jpg")) if p.stat().st_size >= 20_000][:n]
    assert len(found) == n
    return found


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"{url}/invocations", data=body, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _rows(rows: list, params: dict | None = None) -> bytes:
    doc: dict = {"dataframe_split": {"columns": ["image"], "data": [[r] for r in rows]}}
    return json.dumps({**doc, "params": params} if params else doc).encode()


def _version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/version", timeout=30) as answer:
        return str(json.loads(answer.read())["version"])


# another user's Serve application on the same cluster, at "/" behind Serve's own proxy
NEIGHBOUR = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR")
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})

@serve.deployment(ray_actor_options={"num_cpus": 0})
def neighbour(request):
    return "neighbour"

serve.run(neighbour.bind(), name="neighbour", route_prefix="/")
"""
APPLICATIONS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR")
print(json.dumps({n: a.status.value for n, a in serve.status().applications.items()}))
"""


def _driver(code: str, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def _register_two_versions(root: Path, uri: str) -> dict[str, Path]:
    """Versions 1 and 2 of a tiny model (other weights), version 1 the champion."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment("serving", artifact_location=str(root / "artifacts"))
    models = {}
    for seed in (0, 1):
        model = write_tiny_model(root / f"model{seed}", words=WORDS, resize=72, seed=seed)
        registered = log_and_register(
            client,
            model_dir=model,
            model_name=NAME,
            experiment_id=experiment,
            metrics={"bleu_4": 0.1, "cider": 0.1},  # every metric the promotion floor names
            params={},
            tags={"attention": "soft"},
            decoding=DECODING,
        )
        models[registered.version] = model
    promote_if_better(client, NAME, "1", "bleu_4")
    return models


@pytest.fixture(scope="module")
def ray_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServed]:
    from pipeline.ray.runtime import loopback_env

    root = tmp_path_factory.mktemp("ray-serving")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    models = _register_two_versions(root, uri)
    (root / "params.yaml").write_text(PARAMS.format(uri=uri))
    env = {**loopback_env(), "RAY_AUTH_MODE": "token"}
    env = {k: v for k, v in env.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    with ray_nodes(root, env, {}, head_cpus=3) as nodes:
        neighbour_port = free_port()
        _driver(NEIGHBOUR, env, nodes.address, str(neighbour_port))
        args = ["--engine", "ray", "--address", nodes.address]
        with sat_serve(root, args, env, root / "serve.log") as server:
            yield RayServed(
                server, root, uri, models, nodes, env, f"http://127.0.0.1:{neighbour_port}/"
            )


def test_16_concurrent_clients_with_real_photos_are_all_captioned(ray_served: RayServed) -> None:
    photos = _photos(16)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: _post(ray_served.url, _rows([_b64(p)])), photos))
    assert [status for status, _ in answers] == [200] * 16, answers[:2]
    local = Captioner.from_dir(ray_served.models["1"], **DECODING)
    expected = [c.caption.text for c in local.caption_files(photos) if c.caption]
    assert [json.loads(body)["predictions"][0]["caption"] for _, body in answers] == expected


def test_hostile_rows_are_answered_per_row_or_refused_whole(ray_served: RayServed) -> None:

    (photo,) = _photos(1)
    rows = [
        _b64(photo),
        str(ray_served.root / "params.yaml"),  # a file of the server: never opened
        base64.b64encode(png_bomb(16383, 16383)).decode(),
        base64.b64encode(bmp_bomb(300, 300)).decode(),
    ]
    status, body = _post(ray_served.url, _rows(rows))
    assert status == 200, body[:500]
    errors = [p["error"] for p in json.loads(body)["predictions"]]
    assert errors[0] is None
    assert errors[1] == "row 1: not an image: expected base64 or a data: URL"
    assert errors[2].startswith("row 2: decompression bomb guard")
    assert errors[3] == "row 3: BMP images are not accepted (accepted: JPEG, PNG, WEBP)"
    refused = [
        (_rows([_b64(photo)], {"beam_size": 0}), 400, "beam_size must be an integer in 1..10"),
        (_rows(["x" * 3_000_000]), 413, "serve.max_request_bytes is 2000000"),
        (b"a,b\n1,2\n", 415, "send application/json"),
    ]
    for data, code, reason in refused:
        content_type = "text/csv" if code == 415 else "application/json"
        status, body = _post(ray_served.url, data, content_type)
        assert status == code and reason in json.loads(body)["message"], body[:300]
        assert len(body) < 4096 and b"Traceback" not in body
    assert _post(ray_served.url, _rows([_b64(photo)]))[0] == 200  # still serving


def test_a_promoted_version_reaches_the_running_deployment(ray_served: RayServed) -> None:
    (photo,) = _photos(1)
    assert _version(ray_served.url) == "1"
    subprocess.run(
        [str(SAT), "promote", "--version", "2"], cwd=ray_served.root, check=True, timeout=120
    )
    deadline = time.monotonic() + 60
    while _version(ray_served.url) != "2":
        assert time.monotonic() < deadline, "the deployment did not follow @champion"
        time.sleep(1)
    status, body = _post(ray_served.url, _rows([_b64(photo)]))
    (expected,) = Captioner.from_dir(ray_served.models["2"], **DECODING).caption_files([photo])
    assert status == 200 and expected.caption is not None
    assert json.loads(body)["predictions"][0]["caption"] == expected.caption.text


def _session_logs(nodes: RayNodes) -> list[Path]:
    """The log files of the cluster's head (its replicas' among them)."""
    (session,) = nodes.temp_dir("head").glob("session_2*")
    return [p for p in (session / "logs").rglob("*") if p.is_file()]


def test_a_champion_that_fails_its_check_is_refused_once(ray_served: RayServed) -> None:
    """A forged version promoted onto the running deployment: the replicas keep the version
    they serve, and say why once, not at every reload interval (1 s here)."""
    from mlflow import MlflowClient

    client = MlflowClient(ray_served.uri)
    served_now = _version(ray_served.url)
    model = write_tiny_model(ray_served.root / "forged", words=WORDS, resize=72, seed=5)
    forged = log_and_register(
        client,
        model_dir=model,
        model_name=NAME,
        experiment_id=client.get_experiment_by_name("serving").experiment_id,
        metrics={"bleu_4": 0.1},
        params={},
        tags={"attention": "soft"},
        decoding=DECODING,
    )
    (vocab,) = [
        p
        for p in (ray_served.root / "artifacts").rglob("checkpoint/vocab.json")
        if forged.checkpoint_sha256 in (p.parents[2] / "MLmodel").read_text()
    ]
    vocab.write_text(vocab.read_text().replace("circle", "square"))
    client.set_registered_model_alias(NAME, "champion", forged.version)
    time.sleep(8)  # eight reload intervals
    assert _version(ray_served.url) == served_now
    said = sum(
        p.read_text(errors="replace").count(f"refusing models:/{NAME}/{forged.version}")
        for p in _session_logs(ray_served.nodes)
    )
    assert said == 1, said


def test_on_a_shared_cluster_only_its_own_application_comes_and_goes(
    ray_served: RayServed,
) -> None:
    """Runs last: it stops the module's server."""
    env, address = ray_served.env, ray_served.nodes.address
    running = json.loads(_driver(APPLICATIONS, env, address))
    ray_served.server.stop()
    after = json.loads(_driver(APPLICATIONS, env, address))
    with urllib.request.urlopen(ray_served.neighbour, timeout=30) as answer:
        assert answer.read() == b"neighbour"
    port = ray_served.url.rsplit(":", 1)[1]
    ours = [name for name in running if name != "neighbour"]
    assert running["neighbour"] == "RUNNING", running
    assert len(ours) == 1 and ours[0].startswith("sat-") and ours[0].endswith(f"-{port}")
    assert after == {"neighbour": "RUNNING"}, after
