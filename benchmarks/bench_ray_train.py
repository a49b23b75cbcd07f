"""Ray Train scaling on one machine: one worker with 2 threads against two DDP workers with 1 each.

Both runs train the same soft-attention model (params.yaml's ``model`` section) on the same
synthetic captions and random-encoder features (``B`` batch, ``T`` caption steps, ``L``
locations, ``D`` annotation size, as in docs/METHOD.md) through
:func:`pipeline.ray_train.fit_on_ray`
and ``sat_model.train.run.train_model``, so the figures include DDP's gradient all-reduce (gloo)
and the length-grouped sharding. Throughput is training captions per second of wall time over the
epochs after the first (the first pays for worker start-up and allocator warm-up); validation is
one image, so it hardly counts. Scaling efficiency = two-worker throughput / one-worker
throughput: the same 2 cores either way, so 1.0 means DDP costs nothing beyond the threads.

    .venv/bin/python benchmarks/bench_ray_train.py [--captions 2048] [--epochs 4]

JSON to stdout and ``benchmarks/results/ray_train.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import pipeline.ray_runtime  # noqa: F401  (loopback env before ray is imported)
from pipeline.ray_runtime import ray_session
from pipeline.ray_train import ScalingSpec, TrainJob, WorkerRun, fit_on_ray
from sat_model.config import Params, RayConfig, load_params
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE
from sat_model.train.trainer import Callback, EpochState

__all__ = ["main", "write_synthetic_project"]

RESULTS = Path(__file__).resolve().parent / "results" / "ray_train.json"
ROOT = Path(__file__).resolve().parents[1]
L, D = 196, 128  # a 14x14 grid as in the paper; D kept small so the store stays tiny
WORDS = [f"w{i}" for i in range(200)]


def write_synthetic_project(root: Path, captions: int, seed: int = 0) -> None:
    """Prepared captions (8-12 words), vocab and random float16 features (L, D) per image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sat_model.data.vocab import build_vocab, save_vocab
    from sat_model.features.store import FeatureMeta, FeatureWriter

    rng = np.random.default_rng(seed)
    rows = []
    meta = FeatureMeta("random", "none", 224, L, D, 14, 14, "0" * 64)
    for split, n_images in (("train", captions // 5), ("val", 1)):
        ids = [f"{split}{i:05d}" for i in range(n_images)]
        for image_id in ids:
            for k in range(5):  # five captions per image, as in Flickr8k
                tokens = list(rng.choice(WORDS, size=int(rng.integers(8, 13))))
                rows.append((image_id, split, k, tokens))
        feats = rng.standard_normal((n_images, L, D)).astype(np.float16)  # (N, L, D)
        with FeatureWriter(root / "features" / f"{split}.arrow", meta) as writer:
            writer.write(ids, feats)
    prepared = root / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    table = {
        "image_id": [r[0] for r in rows],
        "split": [r[1] for r in rows],
        "file": [f"{r[0]}.png" for r in rows],
        "caption_index": pa.array([r[2] for r in rows], pa.int32()),
        "raw": [" ".join(r[3]) for r in rows],
        "tokens": [r[3] for r in rows],
    }
    pq.write_table(pa.table(table), prepared / CAPTIONS_FILE)
    save_vocab(build_vocab([r[3] for r in rows], 1, 1000, 20), prepared / VOCAB_FILE)


class _EpochTimer(Callback):
    """Rank 0 records each epoch's training seconds and steps (validation: one image)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_epoch_end(self, state: EpochState) -> None:
        self.epochs.append({"epoch": state.epoch, "seconds": state.seconds, "steps": state.steps})


@dataclass(frozen=True)
class _BenchJob:
    """The worker config: the ``train`` stage's own, and where rank 0 writes the epoch times."""

    job: TrainJob
    times_file: Path


def _bench_train_fn(run: WorkerRun) -> None:
    """Every worker: ``train_model`` on its shard; rank 0 writes the epoch times to a file."""
    bench, timer = run.config, _EpochTimer()
    with tempfile.TemporaryDirectory(prefix="sat-bench-") as out:
        result = bench.job.train(run, Path(out), [timer])
    if run.rank == 0:  # the driver's folder: one machine here (a cluster would need shared storage)
        doc = {"train_captions": result.metrics["train_captions"], "epochs": timer.epochs}
        bench.times_file.write_text(json.dumps(doc))


def _run(params: Params, data: Path, workers: int, threads: int) -> dict[str, Any]:
    """One Ray Train run; captions/s over the epochs after the first."""
    tag = f"{workers}x{threads}"
    times_file = data / f"{tag}.json"
    job = TrainJob(params, "soft", data / "prepared", data / "features")
    start = time.perf_counter()
    fit_on_ray(
        _bench_train_fn,
        config=_BenchJob(job, times_file),
        run_name=f"bench-{tag}-{time.time_ns()}",
        storage_path=data / "ray_results",
        scaling=ScalingSpec(num_workers=workers, cpus_per_worker=threads, use_gpu=False),
        max_failures=0,
    )
    wall = time.perf_counter() - start
    doc = json.loads(times_file.read_text())
    timed = doc["epochs"][1:] or doc["epochs"]
    seconds = sum(e["seconds"] for e in timed)
    return {
        "workers": workers,
        "threads_per_worker": threads,
        "train_captions": doc["train_captions"],
        "epoch_seconds": [round(e["seconds"], 3) for e in doc["epochs"]],
        "steps_per_epoch_per_worker": doc["epochs"][0]["steps"],
        "captions_per_s": round(doc["train_captions"] * len(timed) / seconds, 1),
        "run_wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captions", type=int, default=2048, help="training captions")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (first not timed)")
    args = parser.parse_args(argv)
    base = load_params(ROOT / "params.yaml").model_dump(mode="json")
    base["train"]["val_images"], base["train"]["val_max_length"] = 1, 4
    base["train"]["soft"].update(max_epochs=args.epochs, patience=args.epochs)
    params = Params.model_validate_json(json.dumps(base))
    load = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="sat-bench-ray-") as tmp:
        data = Path(tmp)
        write_synthetic_project(data, args.captions)
        with ray_session(RayConfig(num_cpus=2), address="local"):
            one = _run(params, data, workers=1, threads=2)
            two = _run(params, data, workers=2, threads=1)
    result = {
        "benchmark": "ray_train",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1min_at_start": load,  # a shared machine: busy cores skew both runs
        },
        "model": params.model.model_dump(),
        "batch_size": params.train.soft.batch_size,
        "L": L,
        "D": D,
        "one_worker_two_threads": one,
        "two_workers_one_thread": two,
        "scaling_efficiency": round(two["captions_per_s"] / one["captions_per_s"], 3),
        "notes": NOTES,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


NOTES = (
    "Both configurations use the same 2 cores, so this measures what data parallelism costs on a "
    "CPU (gloo all-reduce of every gradient each step, two processes each with its own "
    "interpreter and caches; each rank takes every other length-grouped batch of the full size), "
    "not a speed-up: above "
    "1.0 means two single-threaded processes use the cores better than one two-threaded one "
    "(small matmuls parallelise poorly across threads). On a GPU worker (ray.use_gpu true, one "
    "GPU per worker, NCCL) each worker would run the whole B x T step on its device: per-worker "
    "throughput is expected (not measured here) to rise by one to two orders of magnitude, the "
    "host would only feed batches "
    "(memory-mapped float16 features, cheap), and with several GPUs the all-reduce over NVLink "
    "or PCIe would overlap the backward pass, so scaling efficiency across GPUs is expected near "
    "linear for this model size; the per-step Python loop over T (LSTM steps) would then be the "
    "limit, which batching captions of one length (Sec. 4.3) already keeps small."
)


if __name__ == "__main__":
    main()
