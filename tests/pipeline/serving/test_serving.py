"""Serving the champion: a real ``mlflow server`` and ``sat serve`` (its own front door).

One tracking server and one ``sat serve`` per module, both on free 127.0.0.1 ports. Requests
that are about the server (real photos, rows, body size, content types, idle sockets, bursts,
``beam_size``, memory) go over HTTP; the rest of the hostile-input matrix (paths, pixel bombs,
refused formats, base64 forms) goes to the same registered model loaded in-process through
MLflow's pyfunc, which answers rows with the same code (``sat_model.caption_request``).
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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pipeline.tracking.packaging import log_and_register
from pipeline.tracking.pyfunc_model import CHECKPOINT_ARTIFACT, SatCaptionerModel
from pipeline.tracking.registry import promote_if_better
from sat_model.captioner import Captioner
from sat_model.paths import shared_data
from tests.factories import (
    bmp_bomb,
    gif_bomb,
    jpeg_bomb,
    photo_of_another_shape,
    png_bomb,
    ppm_bomb,
    tiff_bomb,
    webp_bomb,
    write_tiny_model,
)
from tests.pipeline.servers import free_port, mlflow_server

pytestmark = [pytest.mark.mlflow, pytest.mark.slow]
SAT = Path(sys.executable).with_name("sat")
NAME = "sat-captioner"
WORDS = {"a", "red", "circle"}


def _start(command: list[str], health_url: str, log: Path, env=None, cwd=None) -> subprocess.Popen:
    process = subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
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


# how the registered version was scored, so how it is served (the register stage logs the eval
# section's); a tiny model of real words only captions exactly max_length words
DECODING = {"beam_size": 2, "max_length": 4, "length_penalty": 1.5}

PARAMS = """\
serve:
  max_request_bytes: 2000000   # small, so that an oversized request stays cheap to send
  max_rows: 64
  read_timeout_s: 2            # silent sockets are closed after this
"""


@dataclass(frozen=True)
class Served:
    url: str
    pid: int  # ``sat serve``: uvicorn runs in its process
    tracking: str
    root: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Tracking server, one registered champion, and ``sat serve`` on a free port."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("serving")
    backend, artifacts = f"sqlite:///{root / 'mlflow.db'}", str(root / "mlartifacts")
    with mlflow_server(root, backend, artifacts) as tracking:
        client = MlflowClient(tracking)
        model_dir = write_tiny_model(root / "model", words=sorted(WORDS), resize=72)
        registered = log_and_register(
            client,
            model_dir=model_dir,
            model_name=NAME,
            experiment_id=client.create_experiment("serving"),
            metrics={"bleu_4": 0.1},
            params={},
            tags={"attention": "soft"},
            decoding=DECODING,
        )
        promote_if_better(client, NAME, registered.version, "bleu_4")
        (root / "params.yaml").write_text(PARAMS)
        serve_port = free_port()
        env = {**os.environ, "MLFLOW_TRACKING_URI": tracking}
        scoring = _start(
            [str(SAT), "serve", "--params", str(root / "params.yaml"), "--port", str(serve_port)],
            f"http://127.0.0.1:{serve_port}/ping",
            root / "serve.log",
            env=env,
            cwd=root,
        )
        try:
            yield Served(f"http://127.0.0.1:{serve_port}", scoring.pid, tracking, root)
        finally:
            _stop(scoring)


def test_sat_serve_listens_on_loopback_by_default(served):
    import psutil

    tree = [psutil.Process(served.pid), *psutil.Process(served.pid).children(recursive=True)]
    listening = [
        c.laddr.ip for p in tree for c in p.net_connections("inet") if c.status == "LISTEN"
    ]
    assert listening and set(listening) == {"127.0.0.1"}


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
        served.url,
        {
            "dataframe_split": {"columns": ["image"], "data": [[_png_base64()]]},
            "params": {"return_attention": True},
        },
    )
    assert status == 200, body
    (row,) = body["predictions"]
    words = row["caption"].split()
    assert words and set(words) <= WORDS
    attention = row["attention"]  # nested JSON, not JSON text
    assert attention["words"] == words
    assert len(attention["alphas"]) == len(words)
    assert all(len(a) == 16 and abs(sum(a) - 1) < 1e-3 for a in attention["alphas"])


def test_mlflow_models_serve_answers_attention_as_sat_serve_does(served):
    # MLflow's own scoring server runs the logged pyfunc (the artifact's code, this machine's
    # packages); its answer nests attention as `sat serve` does: clients decode JSON once
    request = {
        "dataframe_split": {"columns": ["image"], "data": [[_png_base64()]]},
        "params": {"return_attention": True},
    }
    port = free_port()
    # MLflow runs `uvicorn` by name: the environment's own, as an activated one would find it
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": served.tracking, "PATH": path}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{NAME}@champion"]
    server = _start(
        [*command, "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
        f"http://127.0.0.1:{port}/ping",
        served.root / "mlflow-serve.log",
        env=env,
    )
    try:
        status, body = _post(f"http://127.0.0.1:{port}", request)
    finally:
        _stop(server)
    assert status == 200, body
    (row,) = body["predictions"]
    assert isinstance(row["attention"], dict), row
    status, ours = _post(served.url, request)
    assert status == 200, ours
    (expected,) = ours["predictions"]
    assert row["caption"] == expected["caption"]
    assert row["attention"]["words"] == expected["attention"]["words"]
    assert np.allclose(row["attention"]["alphas"], expected["attention"]["alphas"], atol=1e-5)


def test_a_non_image_gets_a_clear_error_response(served):
    bogus = base64.b64encode(b"this is text, not a picture").decode()
    status, body = _post(served.url, {"dataframe_split": {"columns": ["image"], "data": [[bogus]]}})
    assert status == 400
    assert "no usable image in the request: row 0: not a recognised image" in body["message"]


# ------------------------------------------------------------------ real photos, hostile input
SAMPLE = shared_data("flickr8k-sample")
PHOTOS = SAMPLE / "Flickr8k_Dataset"


def _photos(n: int) -> list[Path]:
    """``n`` sample JPEGs of 20 KB or more (skips the test when the data is absent)."""
    if not PHOTOS.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({PHOTOS})")
    found = [p for p in sorted(PHOTOS.glob("*.jpg")) if p.stat().st_size >= 20_000][:n]
    assert len(found) == n, f"fewer than {n} photos of 20 KB or more in {PHOTOS}"
    return found


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _split(rows: list, params: dict | None = None) -> dict:
    payload: dict = {"dataframe_split": {"columns": ["image"], "data": [[r] for r in rows]}}
    return {**payload, "params": params} if params else payload


def _server_paths(served: Served) -> list[str]:
    """Paths of the serving machine that no response may name."""
    return [str(served.root), sys.prefix, str(Path.home()), "site-packages", "/tmp/"]


def _assert_no_server_path(served: Served, body: object) -> None:
    text = json.dumps(body)
    for path in _server_paths(served):
        assert path not in text, f"response names {path!r}: {text[:500]}"
    assert "Traceback" not in text and "stack_trace" not in text


def test_a_photo_is_decoded_as_the_version_was_registered(served):
    # a client's request without params gets the registered decoding (beam 2, at most 4 words),
    # not the Captioner's defaults (beam 3, 20 words), and its beam_size overrides the beam
    # alone. (Every beam here is 4 words long, so the length penalty cannot show: the
    # registration test of test_cli.py checks it on the loaded model.)
    (photo,) = _photos(1)
    local = Captioner.from_dir(served.root / "model", **DECODING)
    for params, beam in ((None, DECODING["beam_size"]), ({"beam_size": 1}, 1)):
        status, body = _post(served.url, _split([_b64(photo)], params))
        assert status == 200, body
        (row,) = body["predictions"]
        (expected,) = local.caption_files([photo], beam_size=beam)
        assert expected.caption is not None
        assert row["caption"] == expected.caption.text
        assert len(row["caption"].split()) == DECODING["max_length"]


def test_three_photos_garbage_and_a_path_in_one_request(served):
    photos = _photos(3)
    garbage = base64.b64encode(b"just some text, not a picture").decode()
    secret = served.root / "params.yaml"  # a file of the server that exists
    rows = [_b64(p) for p in photos] + [garbage, str(secret)]
    status, body = _post(served.url, _split(rows))
    assert status == 200, body
    preds = body["predictions"]
    assert [bool(p["caption"]) for p in preds] == [True, True, True, False, False]
    assert all(set(p["caption"].split()) <= WORDS for p in preds[:3])
    assert [p["error"] for p in preds[:3]] == [None, None, None]
    assert preds[3]["error"] == "row 3: not a recognised image"
    assert preds[4]["error"] == "row 4: not an image: expected base64 or a data: URL"
    _assert_no_server_path(served, {"predictions": [p["error"] for p in preds]})


def test_a_request_of_bad_rows_only_is_a_400_with_reasons(served):
    rows = ["/etc/passwd", "data:text/html;base64,PGgxPg==", ""]
    status, body = _post(served.url, _split(rows))
    assert status == 400, body
    message = body["message"]
    assert "no usable image in the request" in message
    assert "row 0: not an image: expected base64 or a data: URL" in message
    assert "row 1: data: URL media type 'text/html' is not accepted" in message
    assert "row 2: empty value" in message
    _assert_no_server_path(served, body)


@pytest.mark.parametrize("beam", [-1, 0, 11, 5000, "x"])
def test_beam_size_outside_1_to_10_is_a_clear_400(served, beam):
    status, body = _post(served.url, _split([_png_base64()], {"beam_size": beam}))
    assert status == 400, body
    assert "beam_size" in body["message"]
    assert f"beam_size must be an integer in 1..10, got {beam!r}" in body["message"]
    _assert_no_server_path(served, body)


def test_a_1000_row_request_is_refused_before_decoding(served):
    status, body = _post(served.url, _split([_png_base64()] * 1000))
    assert status == 400, body
    # counted from the body's commas and brackets, before the JSON is parsed
    assert (
        body["message"].startswith("too many rows: ") and "serve.max_rows is 64" in body["message"]
    )


def test_an_oversized_request_is_refused(served):
    # params.yaml of the fixture: serve.max_request_bytes = 2,000,000; 3 MB of valid base64 in
    # three rows is refused from its Content-Length, before the body is read
    chunk = base64.b64encode(os.urandom(750_000)).decode()
    status, body = _post(served.url, _split([chunk] * 3))
    assert status == 413, body
    assert body["message"].startswith("request too large: ")
    assert "serve.max_request_bytes is 2000000" in body["message"]


ACCEPTED_BOMBS = {"PNG": png_bomb, "JPEG": jpeg_bomb, "WEBP": webp_bomb}
REFUSED_BOMBS = {"BMP": bmp_bomb, "GIF": gif_bomb, "TIFF": tiff_bomb, "PPM": ppm_bomb}


@pytest.fixture(scope="module")
def model(served):
    """The champion loaded in-process with the serve params of the fixture's params.yaml."""
    import mlflow

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", served.tracking)  # the registry follows it
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{NAME}@champion", dst_path=str(served.root / "inproc")
        )
    return mlflow.pyfunc.load_model(local, model_config={"serve": {"max_request_bytes": 2_000_000}})


def _one_row(model, value) -> dict:
    import pandas as pd

    (row,) = model.predict(pd.DataFrame({"image": [value, _png_base64()]})).to_dict("records")[:1]
    return row


def _path_cases(tmp: Path) -> dict[str, str]:
    """Each kind of path, every one naming a readable thing that holds (or streams) data."""
    real = tmp / "photo.png"
    real.write_bytes(base64.b64decode(_png_base64()))
    (tmp / "innocent.png").symlink_to(real)
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    return {
        "absolute": str(real),
        "relative": "photo.png",
        "symlink": "innocent.png",
        "dev_zero": "/dev/zero",
        "fifo": str(fifo),
        "file_uri": real.as_uri(),
    }


@pytest.mark.parametrize(
    "kind", ["absolute", "relative", "symlink", "dev_zero", "fifo", "file_uri"]
)
def test_a_path_is_never_opened(model, tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    value = _path_cases(tmp_path)[kind]
    row = _one_row(model, value)  # a FIFO or /dev/zero that was read would block or explode
    assert row["caption"] is None
    assert row["error"] == "row 0: not an image: expected base64 or a data: URL"


@pytest.mark.parametrize("fmt", sorted(ACCEPTED_BOMBS))
@pytest.mark.parametrize("size", [(16383, 16383), (5000, 4000)])
def test_a_pixel_bomb_in_an_accepted_format_is_refused_from_its_header(model, fmt, size):
    data = ACCEPTED_BOMBS[fmt](*size)
    assert len(data) < 1000
    row = _one_row(model, base64.b64encode(data).decode())
    assert row["caption"] is None
    assert row["error"].startswith("row 0: decompression bomb guard: ")
    assert "serve.max_image_pixels = 16000000" in row["error"]


@pytest.mark.parametrize("fmt", sorted(REFUSED_BOMBS))
def test_a_refused_format_is_refused_undecoded(model, fmt):
    row = _one_row(model, base64.b64encode(REFUSED_BOMBS[fmt](7000, 7000)).decode())
    assert row["caption"] is None
    assert row["error"] == f"row 0: {fmt} images are not accepted (accepted: JPEG, PNG, WEBP)"


def test_base64_with_line_breaks_and_data_urls_are_images(model):
    import pandas as pd

    (photo,) = _photos(1)
    text = _b64(photo)
    wrapped = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    rows = [
        wrapped,
        text.replace("A", "A\r\n"),
        f"data:image/jpeg;base64,{wrapped}",
        photo.read_bytes(),
    ]
    out = model.predict(pd.DataFrame({"image": rows}))
    assert out["error"].isna().all(), list(out["error"])
    assert len(set(out["caption"])) == 1  # the same photo, the same caption


def test_a_model_trained_on_squeezed_photos_is_served_a_photo_whole(tmp_path):
    # the served predict (no server needed: the same class MLflow loads) against `sat caption`'s
    # file path, for a model recorded with encoder.keep_aspect false: a real JPEG of another shape
    # sent as base64 is squeezed whole, not centre-cropped, exactly as the file is
    import pandas as pd

    photo = photo_of_another_shape()
    model_dir = write_tiny_model(
        tmp_path / "model", words=sorted(WORDS), crop=64, resize=64, keep_aspect=False
    )
    served = SatCaptionerModel()
    served.load_context(SimpleNamespace(artifacts={CHECKPOINT_ARTIFACT: str(model_dir)}))
    request = pd.DataFrame({"image": [_b64(photo)]})
    (row,) = served.predict(None, request, {"return_attention": True}).to_dict("records")
    (local,) = Captioner.from_dir(model_dir, batch_size=8).caption_files([photo])
    assert row["error"] is None and local.caption is not None
    assert row["caption"] == local.caption.text
    attention = row["attention"]  # an object, as over HTTP
    assert attention["words"] == list(local.caption.words)
    assert np.allclose(attention["alphas"], local.caption.alphas, atol=1e-5)
    assert served.service.captioner.preprocessing.keep_aspect is False


@pytest.mark.parametrize(
    "url, reason",
    [
        ("data:text/plain;base64,{b}", "data: URL media type 'text/plain' is not accepted"),
        ("data:image/gif;base64,{b}", "data: URL media type 'image/gif' is not accepted"),
        ("data:;base64,{b}", "data: URL media type 'none' is not accepted"),
        ("data:image/png,{b}", "data: URL is not base64-encoded (needs ';base64,')"),
        ("data:image/png;base64", "malformed data: URL"),
    ],
)
def test_a_data_url_with_a_wrong_media_type_is_refused(model, url, reason):
    row = _one_row(model, url.format(b=_png_base64()))
    assert row["caption"] is None
    assert row["error"].startswith(f"row 0: {reason}")


def _peak_rss(pid: int) -> int:
    """Sum of the peak RSS (VmHWM) of ``pid`` and its descendants, in bytes."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        status = Path(f"/proc/{p.pid}/status").read_text()
        kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        total += int(kb) * 1024
    return total


# the serving tree (sat serve, mlflow models serve, uvicorn with torch and the model) peaks near
# 1.3 GiB here; one decoded 16383x16383 bomb alone would add over 0.75 GiB
RSS_BOUND = 2 * 2**30
RSS_GROWTH_BOUND = 384 * 2**20


def test_bombs_over_http_leave_memory_bounded_and_the_server_answering(served):
    if not Path("/proc/self/status").exists():
        pytest.skip("peak RSS is read from /proc")
    bombs = [f(16383, 16383) for f in ACCEPTED_BOMBS.values()]
    bombs += [f(7000, 7000) for f in REFUSED_BOMBS.values()]
    before = _peak_rss(served.pid)
    for _ in range(3):
        status, body = _post(served.url, _split([base64.b64encode(b).decode() for b in bombs]))
        assert status == 400, body
        assert body["message"].count("decompression bomb guard") == 3
        assert body["message"].count("images are not accepted") == 4
    (photo,) = _photos(1)
    status, body = _post(served.url, _split([_b64(photo)]))
    assert status == 200 and body["predictions"][0]["caption"], body
    after = _peak_rss(served.pid)
    mib = f"peak RSS {after / 2**20:.0f} MiB, {before / 2**20:.0f} MiB before the bombs"
    print(mib)
    assert after < RSS_BOUND, mib
    assert after - before < RSS_GROWTH_BOUND, mib


# ------------------------------------------------------------------------- the front door
MAX_ERROR_BODY = 4096


def _raw(served: Served, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"{served.url}/invocations", data=body, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))


def _parquet_bomb() -> bytes:
    """A tiny zstd Parquet file that pandas would expand to 64 x 16 MB of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(["A" * 16_000_000] * 64).dictionary_encode()
    buffer = io.BytesIO()
    pq.write_table(pa.table({"image": column}), buffer, compression="zstd")
    return buffer.getvalue()


def test_hostile_bodies_are_refused_unparsed_with_a_short_reason(served):
    if not Path("/proc/self/status").exists():
        pytest.skip("RSS is read from /proc")
    bomb = _parquet_bomb()
    assert len(bomb) < 200_000
    cases = [
        (bomb, "application/x-parquet", 415, "send application/json, not application/x-parquet"),
        (bomb, "application/vnd.apache.parquet", 415, "send application/json"),
        (b'image\n"unterminated,,,\x00\n' * 1000, "text/csv", 415, "not text/csv"),
        (os.urandom(50_000), "application/octet-stream", 415, "send application/json"),
        (bomb, "application/json", 400, "the body is not"),
        (b"\xff\xfe\xfa" + os.urandom(1_000_000), "application/json", 400, "not UTF-8"),
        (b"\xff" * 16_000_000, "application/json", 413, "serve.max_request_bytes is 2000000"),
        (b'{"dataframe_split": {"columns": ["image"], "data": [[', "application/json", 400, "JSON"),
        (b'{"dataframe_split": {"columns": ["x"], "data": []}}', "application/json", 400, "image"),
        (b'{"inputs": [], "params": {"evil": 1}}', "application/json", 400, "unknown params"),
    ]
    before = _rss(served.pid)
    for _ in range(4):  # as many as a client may send at once
        for body, content_type, status, reason in cases:
            got, answer = _raw(served, body, content_type)
            assert got == status, (content_type, answer[:300])
            assert len(answer) < MAX_ERROR_BODY, (content_type, len(answer))
            assert reason in json.loads(answer)["message"], answer[:300]
            _assert_no_server_path(served, json.loads(answer))
    grown = (_rss(served.pid) - before) / 1024
    assert grown < 300, f"RSS grew {grown:.0f} MiB"
    (photo,) = _photos(1)
    status, body = _post(served.url, _split([_b64(photo)]))
    assert status == 200 and body["predictions"][0]["caption"], body


def test_idle_sockets_block_nothing_and_are_closed(served):
    """Four sockets that send nothing, one that stops inside its headers: a real request is
    answered meanwhile, and all five are closed after serve.read_timeout_s (2 s here)."""
    port = int(served.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\n")
    try:
        with urllib.request.urlopen(f"{served.url}/ping", timeout=10) as response:
            assert response.status == 200
        (photo,) = _photos(1)
        status, body = _post(served.url, _split([_b64(photo)]))
        assert status == 200 and body["predictions"][0]["caption"], body
        for s in [*idle, slow]:
            s.settimeout(10)
            assert s.recv(1024) == b""  # closed by the server, not by this timeout
    finally:
        for s in [*idle, slow]:
            s.close()


def test_a_burst_of_16_one_row_requests_is_served(served):
    from concurrent.futures import ThreadPoolExecutor

    photos = _photos(16)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: _post(served.url, _split([_b64(p)])), photos))
    assert [status for status, _ in answers] == [200] * 16, answers
    assert all(set(b["predictions"][0]["caption"].split()) <= WORDS for _, b in answers)


def _sat_serve(served: Served, model: str, tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": served.tracking, "TMPDIR": str(tmp)}
    port = free_port()
    command = [str(SAT), "serve", "--model", model, "--port", str(port)]
    process = _start(command, f"http://127.0.0.1:{port}/ping", tmp / "serve.log", env, tmp)
    process.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return process


def _register_another(served: Served, name: str, seed: int) -> tuple[str, Path]:
    """A new registered version (``seed``: other weights); its number and its model folder in
    the artifact store."""
    from mlflow import MlflowClient

    client = MlflowClient(served.tracking)
    model_dir = write_tiny_model(served.root / name, words=sorted(WORDS), resize=72, seed=seed)
    registered = log_and_register(
        client,
        model_dir=model_dir,
        model_name=NAME,
        experiment_id=client.get_experiment_by_name("serving").experiment_id,
        metrics={"bleu_4": 0.05},
        params={},
        tags={"attention": "soft"},
        decoding=DECODING,
    )
    assert not registered.reused
    (mlmodel,) = [
        m
        for m in (served.root / "mlartifacts").rglob("MLmodel")
        if registered.checkpoint_sha256 in m.read_text()
    ]
    return registered.version, mlmodel.parent


def test_code_in_the_artifact_is_never_run(served, tmp_path):
    version, stored = _register_another(served, "tampered-code", seed=7)
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'w').write('x')\n"
    codes = [*stored.rglob("pyfunc_model.py"), *stored.rglob("sat_model/__init__.py")]
    assert len(codes) == 2, codes  # the served model's own file and its copy of the library
    for code in codes:
        code.write_text(payload + code.read_text())
    process = _sat_serve(served, f"models:/{NAME}/{version}", tmp_path)
    try:
        (photo,) = _photos(1)
        status, body = _post(process.url, _split([_b64(photo)]))  # type: ignore[attr-defined]
        assert status == 200 and body["predictions"][0]["caption"], body
        with urllib.request.urlopen(f"{process.url}/version") as answer:  # type: ignore[attr-defined]
            assert json.loads(answer.read())["version"] == version
    finally:
        _stop(process)
    assert not marker.exists()


def test_version_of_a_folder_model_names_no_server_path(served, tmp_path):
    _, stored = _register_another(served, "folder-model", seed=9)
    process = _sat_serve(served, str(stored), tmp_path)
    try:
        with urllib.request.urlopen(f"{process.url}/version") as answer:  # type: ignore[attr-defined]
            shown = json.loads(answer.read())
    finally:
        _stop(process)
    assert shown["model"] == stored.name and shown["checkpoint_sha256"], shown
    assert str(stored.parent) not in json.dumps(shown)


def test_a_checkpoint_that_does_not_match_its_record_is_refused(served, tmp_path):
    version, stored = _register_another(served, "tampered-weights", seed=8)
    (vocab,) = stored.rglob("checkpoint/vocab.json")
    vocab.write_text(vocab.read_text().replace("circle", "square"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": served.tracking}
    done = subprocess.run(
        [str(SAT), "serve", "--model", f"models:/{NAME}/{version}", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"sat serve: error: refusing models:/{NAME}/{version}: its checkpoint")
    assert "recorded when it was registered" in line


def test_a_sigkilled_sat_serve_leaves_no_process_and_no_folder(served, tmp_path):
    import psutil

    process = _sat_serve(served, f"models:/{NAME}@champion", tmp_path)
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    os.kill(process.pid, 9)
    process.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(p.is_running() for p in tree):
        time.sleep(0.2)
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not list(tmp_path.glob("sat-serve-*"))


def test_a_tracking_server_that_is_down_fails_at_once_and_keeps_its_credentials(tmp_path):
    # MLflow alone retries for about four minutes; mlflow.retries (3) bounds it to seconds
    down = f"http://alice:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        [str(SAT), "serve", "--port", str(free_port())],
        cwd=tmp_path,
        env={**os.environ, "MLFLOW_TRACKING_URI": down},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("sat serve: error: cannot load models:/sat-captioner@champion from ")
    assert "s3cret" not in done.stderr + done.stdout and "http://***@127.0.0.1" in line


@pytest.mark.parametrize(
    "model_arg, store, expected",
    [
        (None, False, "cannot load models:/sat-captioner@champion: there is no MLflow store at"),
        (None, True, "cannot load models:/sat-captioner@champion from sqlite:///"),
        ("runs:/0123456789abcdef/model", True, "Run with id=0123456789abcdef not found"),
        ("no/such/folder", False, "no/such/folder is not an MLflow model folder (no MLmodel file)"),
        (None, False, "serve.max_rows: Input should be greater than or equal to 1"),
    ],
)
def test_sat_serve_user_errors_are_one_line_and_exit_1(tmp_path, model_arg, store, expected):
    """No champion (no store, an empty store), a bad URI or folder, bad params: one line."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"  # from params, not MLFLOW_TRACKING_URI
    if store:
        MlflowClient(uri).search_experiments()  # creates the store's tables
    (tmp_path / "params.yaml").write_text(f"mlflow: {{tracking_uri: '{uri}'}}\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    extra = ["--model", model_arg] if model_arg else []
    extra += ["-S", "serve.max_rows=0"] if "max_rows" in expected else []
    done = subprocess.run(
        [str(SAT), "serve", "--port", str(free_port()), *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sat serve: error: "), done.stderr
    assert expected in lines[0]
    if model_arg is None and "max_rows" not in expected:
        assert lines[0].endswith("(run `make run` to register a champion, or pass --model)")
