"""Serving and batch captioning: Ray Serve against MLflow's scoring server and ``sat serve``, Ray
Data against one process.

Serving: the same registered model (untrained, over the default encoder EfficientNet-Lite0)
served by MLflow's own scoring server (``mlflow models serve``, the issue's baseline), by
``sat serve`` (the local engine) and by ``sat serve --engine ray`` on a local Ray, all up on the
same cores and loaded in turn, round by round (the order rotating); 16 client threads each post
one real photo per request (base64 in JSON, as a client does) for a fixed time; images/s and
latency percentiles over the answered requests, medians over rounds.

Batch captioning, on the same photos, interleaved round by round: ``sat caption``'s one-process
path (:meth:`Captioner.caption_files`); the encoder and the beam search alone on the photos
already decoded and cut (what is left once decoding costs nothing); the encoder's forward pass
alone; Ray Data (:func:`pipeline.ray.caption.caption_with_ray_data`, one actor, on a Ray
started beforehand) over a quarter and all of the photos, whose difference leaves out the job's
fixed costs (actor start, model load).

    .venv/bin/python benchmarks/bench_serving.py [--seconds 30] [--clients 16] [--images 128]

JSON to stdout and ``benchmarks/results/serving.json``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SAT = Path(sys.executable).with_name("sat")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_caption import DEFAULT_FLICKR, _lite0_model_dir, _photos  # noqa: E402

NAME = "bench-captioner"


def _register(root: Path) -> str:
    """The Lite0 model registered as champion in a fresh SQLite store; its tracking URI."""
    from mlflow import MlflowClient

    from pipeline.tracking.packaging import log_and_register
    from pipeline.tracking.registry import promote_if_better

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("bench", artifact_location=str(root / "artifacts"))
    _lite0_model_dir(root / "model")
    version = log_and_register(
        client,
        model_dir=root / "model",
        model_name=NAME,
        experiment_id=experiment,
        metrics={"bleu_4": 0.0},
        params={},
        tags={},
        decoding={"beam_size": 3, "max_length": 20},
    ).version
    promote_if_better(client, NAME, version, "bleu_4")
    (root / "params.yaml").write_text(
        f"mlflow: {{tracking_uri: '{uri}', model_name: {NAME}}}\n"
        "serve: {max_queued_requests: 64}\n"
    )
    return uri


def _serve(root: Path, engine: str, port: int, uri: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    command = [str(SAT), "serve", "--engine", engine, "--port", str(port)]
    if engine == "mlflow":  # MLflow's scoring server of the same champion, in this venv
        env["MLFLOW_TRACKING_URI"] = uri
        env["PATH"] = f"{SAT.parent}{os.pathsep}{env.get('PATH', '')}"
        model = f"models:/{NAME}@champion"
        command = [str(SAT.with_name("mlflow")), "models", "serve", "-m", model]
        command += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5).close()
            return process
        except OSError:
            assert process.poll() is None, f"sat serve --engine {engine} exited"
            time.sleep(1)
    raise TimeoutError(f"sat serve --engine {engine} did not answer")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _load(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` threads posting one-photo requests back to back for ``seconds``."""
    latencies: list[float] = []
    failures = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(k: int) -> None:
        nonlocal failures
        i = k
        while time.monotonic() < stop_at:
            request = urllib.request.Request(
                f"{url}/invocations",
                data=bodies[i % len(bodies)],
                headers={"Content-Type": "application/json"},
            )
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=300) as answer:
                    answer.read()
                ok = True
            except OSError:
                ok = False
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    failures += 1
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started  # requests in flight at the deadline finish too
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else [float("nan")] * 19
    return {
        "answered": len(latencies),
        "failed": failures,
        "seconds": wall,
        "images_per_s": len(latencies) / wall,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": q[18],
    }


def bench_serving(
    root: Path, uri: str, photos: list[Path], clients: int, seconds: float, rounds: int
) -> dict:
    """The servers up at once, loaded in turn (the order rotating round by round), so a
    machine whose load drifts slows them alike; medians over rounds."""
    rows = [[[base64.b64encode(p.read_bytes()).decode()]] for p in photos]
    split = [{"dataframe_split": {"columns": ["image"], "data": r}} for r in rows]
    bodies = [json.dumps(doc).encode() for doc in split]
    engines = {"mlflow": 18760, "local": 18761, "ray": 18762}
    processes = [_serve(root, engine, port, uri) for engine, port in engines.items()]
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    try:
        for port in engines.values():
            _load(f"http://127.0.0.1:{port}", bodies[:4], 4, 5)  # warm-up
        for r in range(rounds):
            order = list(engines)[r % 3 :] + list(engines)[: r % 3]
            for engine in order:
                url = f"http://127.0.0.1:{engines[engine]}"
                runs[engine].append(_load(url, bodies, clients, seconds))
    finally:
        for process in processes:
            _stop(process)
    figures: dict = {}
    for engine, results in runs.items():
        figures[engine] = {
            "rounds": results,
            "images_per_s": statistics.median(x["images_per_s"] for x in results),
            "latency_p50_s": statistics.median(x["latency_p50_s"] for x in results),
            "latency_p95_s": statistics.median(x["latency_p95_s"] for x in results),
        }
    for engine in ("ray", "local"):
        figures[f"{engine}_over_mlflow_images_per_s"] = (
            figures[engine]["images_per_s"] / figures["mlflow"]["images_per_s"]
        )
    figures["ray_over_local_images_per_s"] = (
        figures["ray"]["images_per_s"] / figures["local"]["images_per_s"]
    )
    return figures


def _rate(captioner: Any, photos: list[Path], pixels: list[Any], how: str) -> float:
    """Images/s of ``sat caption``'s one-process path (``files``: decode, cut, encode, beam
    search), of the same on the photos already decoded and cut (``decoded``: ``pixels`` uint8;
    the encoder and the beam search alone), or of the encoder's forward pass alone
    (``encoder``: ``pixels`` normalised)."""
    import torch

    start = time.perf_counter()
    if how == "encoder":
        with torch.inference_mode():
            for batch in pixels:
                captioner.encoder(batch)
    elif how == "decoded":
        for batch in pixels:
            captioner.caption_pixels(batch)
    else:
        list(captioner.caption_files(photos))
    return len(photos) / (time.perf_counter() - start)


def _ray_data_seconds(root: Path, photos: list[Path], options: dict, name: str) -> float:
    from pipeline.ray.caption import caption_with_ray_data

    folder = root / name
    folder.mkdir()
    for p in photos:
        (folder / p.name).symlink_to(p)
    start = time.perf_counter()
    result = caption_with_ray_data(
        str(folder),
        str(root / f"{name}-out"),
        root / "model",
        options,
        max_pixels=50_000_000,
    )
    assert result.rows == len(photos) and result.errors == 0
    return time.perf_counter() - start


def bench_batch(root: Path, photos: list[Path], batch_size: int, rounds: int) -> dict:
    import ray
    import torch

    from sat_model.captioner import Captioner
    from sat_model.features.images import normalize_pixels

    options = {"beam_size": 3, "max_length": 20, "batch_size": batch_size}
    captioner = Captioner.from_dir(root / "model", **options)
    list(captioner.caption_files(photos[:batch_size]))  # warm-up
    cut = torch.stack([captioner.preprocessing.pixels(p) for p in photos])  # (N, 3, S, S) uint8
    pixels = list(normalize_pixels(cut, *captioner.encoder.spec.normalization()).split(batch_size))
    cuts = list(cut.split(batch_size))
    ways = ["encoder", "decoded", "files", "ray_data"]
    rates: dict[str, list[float]] = {how: [] for how in ways}
    part, wholes = photos[: len(photos) // 4], []
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    try:
        for r in range(rounds):  # interleaved, the order rotating: a drifting load slows all
            for how in ways[r % 4 :] + ways[: r % 4]:
                if how == "ray_data":
                    # a quarter and all of the photos: the difference cancels the job's fixed
                    # costs (actor start, model load), leaving the streaming rate
                    small = _ray_data_seconds(root, part, options, f"part{r}")
                    wholes.append(_ray_data_seconds(root, photos, options, f"whole{r}"))
                    rates[how].append((len(photos) - len(part)) / (wholes[-1] - small))
                    continue
                given = cuts if how == "decoded" else pixels
                rates[how].append(_rate(captioner, photos, given, how))
    finally:
        ray.shutdown()
    encoder, decoded = statistics.median(rates["encoder"]), statistics.median(rates["decoded"])
    one_process, ray_data = statistics.median(rates["files"]), statistics.median(rates["ray_data"])
    whole = statistics.median(wholes)
    return {
        "images": len(photos),
        "one_process_images_per_s": one_process,
        "ray_data_job_images_per_s": len(photos) / whole,  # actor start and model load included
        "ray_data_fixed_seconds": whole - len(photos) / ray_data,
        "ray_data_images_per_s": ray_data,
        "encoder_only_images_per_s": encoder,
        # the encoder and the beam search on decoded photos: decoding for free
        "decoded_images_per_s": decoded,
        "decoded_over_encoder_only": decoded / encoder,
        "one_process_over_encoder_only": one_process / encoder,
        "ray_data_over_encoder_only": ray_data / encoder,
        "ray_data_over_one_process": ray_data / one_process,
        "images_per_s_by_round": rates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20, help="of load per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--flickr8k", type=Path, default=DEFAULT_FLICKR)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serving.json")
    parser.add_argument(
        "--only", choices=["serving", "batch"], help="one half of the benchmark (default: both)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, photos = _photos(args.flickr8k, args.images, Path(tmp))
        root = Path(tmp) / "bench"
        root.mkdir()
        uri = _register(root)
        serving, batch = None, None
        if args.only != "batch":
            serving = bench_serving(root, uri, photos, args.clients, args.seconds, args.rounds)
        if args.only != "serving":
            batch = bench_batch(root, photos, args.batch_size, args.rounds)
    result = {
        "source": source,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "clients": args.clients,
        "seconds": args.seconds,
        "serving": serving,
        "batch_captioning": batch,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
