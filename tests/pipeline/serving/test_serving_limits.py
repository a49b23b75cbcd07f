"""Slow, big and crafted bodies against ``sat serve`` on both engines, from outside, over HTTP.

One server per engine (``sat serve`` of the champion and ``sat serve --engine ray`` of the pinned
version 1, each on a free 127.0.0.1 port, a SQLite store with one registered tiny model), stopped
by its process group. Each test
does what a hostile or clumsy client does and measures what the issue asks: the status, how
long a well-behaved client waits meanwhile, and the memory of the process that reads the bodies
(``sat serve`` itself: on both engines the front door runs there).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.registry import promote_if_better
from sat_model.paths import shared_data
from tests.factories import write_tiny_model
from tests.pipeline.servers import sat_serve

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]
NAME = "sat-captioner"
PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
# the default body limit (32 MB, so the 31 MB body below is within it); read_timeout_s short, so
# idle sockets close within the test
PARAMS = """\
mlflow: {{tracking_uri: '{uri}'}}
serve:
  read_timeout_s: 2
  ray: {{reload_interval_s: 0, max_batch_size: 4}}
"""
MiB = 2**20


@dataclass(frozen=True)
class Server:
    engine: str
    url: str
    port: int
    pid: int  # ``sat serve``: its front door reads every body
    log: Path


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp(f"limits-{request.param}")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    registered = log_and_register(
        client,
        model_dir=write_tiny_model(root / "model", resize=72),
        model_name=NAME,
        experiment_id=client.create_experiment("serving", str(root / "artifacts")),
        metrics={"bleu_4": 0.1},
        params={},
        tags={"attention": "soft"},
        decoding={"beam_size": 1, "max_length": 4},
    )
    promote_if_better(client, NAME, registered.version, "bleu_4")
    (root / "params.yaml").write_text(PARAMS.format(uri=uri))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    log = root / "serve.log"
    # the Ray engine serves a pinned version (the champion alias is followed by test_ray_serving)
    args = ["--engine", request.param]
    args += ["--model", f"models:/{NAME}/1"] if request.param == "ray" else []
    with sat_serve(root, args, env, log) as served:
        assert _post(served.url, _photo_body())[0] == 200  # warm: memory is measured after one
        port = int(served.url.rsplit(":", 1)[1])
        yield Server(request.param, served.url, port, served.pid, log)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return 1024 * int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS")))


def _photo_body() -> bytes:
    if not PHOTOS.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({PHOTOS})")
    photo = next(p for p in sorted(PHOTOS.glob("*.jpg")) if p.stat().st_size >= 20_000)
    rows = [[base64.b64encode(photo.read_bytes()).decode()]]
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": rows}}).encode()


def _post(url: str, body: bytes, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/invocations", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _served_once_free(url: str, body: bytes, within_s: float) -> tuple[int, float]:
    """Post ``body`` as a polite client does (again after ``Retry-After`` on a 503) until it is
    answered otherwise or ``within_s`` has passed: its status and the seconds it took."""
    start = time.monotonic()
    while True:
        status, _answer = _post(url, body)
        if status != 503 or time.monotonic() - start > within_s:
            return status, time.monotonic() - start
        time.sleep(1)


def _head(port: int, length: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )
    return s


def _status(s: socket.socket, timeout: float) -> int:
    """The status of the answer on ``s`` (0 if it closed without one)."""
    s.settimeout(timeout)
    seen = b""
    try:
        while b"\r\n" not in seen:
            chunk = s.recv(4096)
            if not chunk:
                break
            seen += chunk
    except ConnectionResetError:
        pass
    return int(seen.split()[1]) if seen.startswith(b"HTTP/1.1 ") else 0


def _trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    """One byte per socket every half second (2 bytes/s each), until ``stop``."""
    while not stop.wait(0.5):
        for s in sockets:
            with contextlib.suppress(OSError):
                s.sendall(b" ")


def test_32_slow_bodies_do_not_keep_a_fresh_client_waiting(server: Server) -> None:
    """32 clients send a 100 kB body at 2 bytes/s each, within serve.read_timeout_s between
    bytes: they would hold all 32 admission slots for 14 hours. They are cut at the minimum
    rate (408) and a fresh client is captioned within seconds."""
    body = _photo_body()
    before = _rss(server.pid)
    slow = [_head(server.port, 100_000) for _ in range(32)]
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(slow, stop), daemon=True)
    trickler.start()
    try:
        time.sleep(0.3)  # all 32 admitted
        status, waited = _served_once_free(server.url, body, within_s=30)
        statuses = [_status(s, timeout=10) for s in slow]
    finally:
        stop.set()
        trickler.join()
        for s in slow:
            s.close()
    grown = (_rss(server.pid) - before) / MiB
    print(f"{server.engine}: fresh client {status} after {waited:.1f} s, +{grown:.1f} MiB")
    assert status == 200 and waited < 8, (status, waited)
    assert statuses == [408] * 32, statuses
    assert grown < 32, grown


def _send_zeros(s: socket.socket, size: int) -> None:
    chunk = bytes(2**20)
    try:
        for _ in range(size // len(chunk)):
            s.sendall(chunk)
    except OSError:  # the server closed once it had refused and drained its share
        pass


def _big_body(port: int, size: int) -> tuple[int, float]:
    s = _head(port, size)
    sender = threading.Thread(target=_send_zeros, args=(s, size), daemon=True)
    start = time.monotonic()
    sender.start()
    try:
        return _status(s, timeout=60), time.monotonic() - start
    finally:
        s.close()
        sender.join()


def test_a_200_mb_body_is_refused_with_413_and_memory_stays_flat(server: Server) -> None:
    """Twice with the server idle, then once while 32 slow bodies hold every admission slot:
    the body is refused from its head, never held, whatever the load."""
    before = _rss(server.pid)
    answers = [_big_body(server.port, 200_000_000) for _ in range(2)]
    slow = [_head(server.port, 100_000) for _ in range(32)]
    try:
        time.sleep(0.2)
        answers.append(_big_body(server.port, 200_000_000))
    finally:
        for s in slow:
            s.close()
    grown = (_rss(server.pid) - before) / MiB
    print(f"{server.engine}: 200 MB bodies {answers}, +{grown:.1f} MiB")
    assert [status for status, _ in answers] == [413] * 3, answers
    assert grown < 8, grown


def _ping_times(url: str, stop: threading.Event, times: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        urllib.request.urlopen(f"{url}/ping", timeout=60).close()
        times.append(time.monotonic() - start)
        time.sleep(0.05)


def test_31_mb_of_empty_rows_is_refused_without_stalling_ping(server: Server) -> None:
    body = b'{"inputs": [' + b"[]," * 10_000_000 + b"[]]}"
    assert len(body) < 32_000_000  # within serve.max_request_bytes: only its rows are wrong
    before = _rss(server.pid)
    stop, pings = threading.Event(), []
    pinger = threading.Thread(target=_ping_times, args=(server.url, stop, pings), daemon=True)
    pinger.start()
    try:
        start = time.monotonic()
        status, answer = _post(server.url, body)
        took = time.monotonic() - start
        time.sleep(0.3)
    finally:
        stop.set()
        pinger.join()
    grown = (_rss(server.pid) - before) / MiB
    print(
        f"{server.engine}: {status} in {took:.2f} s, slowest /ping {max(pings):.2f} s, "
        f"+{grown:.0f} MiB"
    )
    assert status == 400 and "serve.max_rows" in answer["message"], answer
    assert max(pings) < 2 and took < 10, (max(pings), took)
    assert grown < 100, grown


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"[" * 100_000, "too many rows: the body holds 100000 JSON commas and brackets"),
        (b'{"inputs": [' + b"7" * 5000 + b"]}", "not JSON this server reads"),
        (b'{"inputs": ' + b"[" * 500, "the body is not JSON"),
    ],
    ids=["deep-nesting", "5000-digit-integer", "unclosed-within-the-bound"],
)
def test_crafted_json_gets_the_json_400_and_no_traceback(
    server: Server, body: bytes, reason: str
) -> None:
    status, answer = _post(server.url, body)
    assert status == 400 and answer["error_code"] == "BAD_REQUEST", answer
    assert reason in answer["message"], answer
    assert "Traceback" not in server.log.read_text(errors="replace")


def test_100_idle_sockets_are_closed(server: Server) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    try:
        urllib.request.urlopen(f"{server.url}/ping", timeout=10).close()
        start = time.monotonic()
        closed = 0
        for s in idle:
            s.settimeout(max(0.1, 15 - (time.monotonic() - start)))
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                closed += s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    print(f"{server.engine}: {closed} of 100 idle sockets closed")
    assert closed == 100
