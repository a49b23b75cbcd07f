"""Ray Train across nodes: one worker on one node against two DDP workers on two nodes.

A real two-node Ray cluster on this machine (``ray start --head`` and ``ray start --address``,
one CPU each, each in its own process group: ``tests/pipeline/ray_cluster.py``'s ``ray_nodes``, the
cluster the cluster tests start) runs, in one invocation and on the same data, the ``train``
stage's own worker function (:func:`pipeline.ray.train.sat_train_fn` on a
:class:`~pipeline.ray.train.TrainJob`) with one worker (1 CPU), then with two workers placed
``STRICT_SPREAD`` (one per node, 1 CPU each). Same soft-attention model (params.yaml's
``model`` section), synthetic captions and random-encoder features (``B`` batch, ``T`` caption
steps, ``L`` locations, ``D`` annotation size, as in docs/METHOD.md); DDP's gradient all-reduce
(gloo) between the nodes and the length-grouped sharding are in the figures.

Throughput is what the driver's progress lines report (:mod:`pipeline.ray.progress`): training
captions summed over ranks per second of the slowest rank's training pass, over the epochs after
the first (the first pays for worker start-up and allocator warm-up); validation is one image.
Scaling efficiency = two-worker throughput / (2 x one-worker throughput): 1.0 is linear.

    .venv/bin/python benchmarks/bench_ray_train.py [--captions 2048] [--epochs 4]

JSON to stdout and ``benchmarks/results/ray_train.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import pipeline.ray.runtime  # noqa: F401  (loopback env before ray is imported)
from pipeline.ray.fit import ScalingSpec, fit_on_ray
from pipeline.ray.progress import epoch_progress
from pipeline.ray.runtime import loopback_env, ray_session
from pipeline.ray.train import TrainJob, sat_train_fn
from pipeline.settings import Params, RayConfig, load_params, validate_params
from sat_model.data.tables import CAPTIONS_FILE, VOCAB_FILE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the cluster helpers of the tests: run as a script from anywhere
from tests.pipeline.ray_cluster import ray_nodes  # noqa: E402

__all__ = ["main", "write_synthetic_project"]

RESULTS = Path(__file__).resolve().parent / "results" / "ray_train.json"
L, D = 196, 128  # a 14x14 grid as in the paper; D kept small so the store stays tiny
WORDS = [f"w{i}" for i in range(200)]


def write_synthetic_project(root: Path, captions: int, seed: int = 0) -> None:
    """Prepared captions (8-12 words), vocab and random float16 features (L, D) per image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sat_model.data.vocab import build_vocab, save_vocab
    from sat_model.features.spec import EncoderSpec
    from sat_model.features.store import FeatureWriter

    rng = np.random.default_rng(seed)
    rows = []
    spec = EncoderSpec("random", "none", 224, L, D, 14, 14, "0" * 64)
    for split, n_images in (("train", captions // 5), ("val", 1)):
        ids = [f"{split}{i:05d}" for i in range(n_images)]
        for image_id in ids:
            for k in range(5):  # five captions per image, as in Flickr8k
                tokens = list(rng.choice(WORDS, size=int(rng.integers(8, 13))))
                rows.append((image_id, split, k, tokens))
        feats = rng.standard_normal((n_images, L, D)).astype(np.float16)  # (N, L, D)
        with FeatureWriter(root / "features" / f"{split}.arrow", spec) as writer:
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


def _run(params: Params, data: Path, workers: int, placement: str) -> dict[str, Any]:
    """One Ray Train run of the train stage's worker function; captions/s after epoch 1."""
    job = TrainJob(params, "soft", data / "prepared", data / "features")
    start = time.perf_counter()
    with epoch_progress(f"bench {workers} worker(s)", params.train.soft.max_epochs) as progress:
        fit_on_ray(
            sat_train_fn,
            config=job,
            run_name=f"bench-{workers}-{time.time_ns()}",
            storage_path=data / "ray_results",
            scaling=ScalingSpec(
                workers, cpus_per_worker=1, use_gpu=False, placement_strategy=placement
            ),
            max_failures=0,
            callbacks=[progress.callback],
        )
    wall = time.perf_counter() - start
    timed = progress.reports[1:] or progress.reports
    captions = sum(r.captions for r in timed)
    seconds = sum(r.train_seconds for r in timed)
    return {
        "workers": workers,
        "cpus_per_worker": 1,
        "placement_strategy": placement,
        "captions_per_epoch": progress.reports[0].captions,
        "train_seconds_per_epoch": [round(r.train_seconds, 3) for r in progress.reports],
        "captions_per_s": round(captions / seconds, 1),
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
    params = validate_params(base)
    load = round(os.getloadavg()[0], 2)
    os.environ["RAY_AUTH_MODE"] = "token"  # `ray start` turns token authentication on
    env = loopback_env()
    with tempfile.TemporaryDirectory(prefix="sat-bench-ray-") as tmp:
        data = Path(tmp)
        write_synthetic_project(data, args.captions)
        # every node on this machine reads the driver's folder: the inputs are shared
        with (
            ray_nodes(data, env, {"node2": 1}, head_cpus=1) as nodes,
            ray_session(RayConfig(), address=nodes.address),
        ):
            one = _run(params, data, workers=1, placement="PACK")
            two = _run(params, data, workers=2, placement="STRICT_SPREAD")
    result = {
        "benchmark": "ray_train",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1min_at_start": load,  # a shared machine: busy cores skew both runs
        },
        "cluster": "two `ray start` nodes on 127.0.0.1, 1 CPU each",
        "model": params.model.model_dump(),
        "batch_size": params.train.soft.batch_size,
        "L": L,
        "D": D,
        "one_worker_one_node": one,
        "two_workers_two_nodes": two,
        "scaling_efficiency": round(two["captions_per_s"] / (2 * one["captions_per_s"]), 3),
        "notes": NOTES,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


NOTES = (
    "One worker holds one CPU of one node; two workers hold one CPU on each of two nodes (two "
    "`ray start` processes on this machine, so 'two nodes' share its cores and its memory bus, "
    "and the all-reduce goes over loopback TCP, not a network). Each rank takes every other "
    "length-grouped batch of the full size, so an epoch trains the same captions either way and "
    "1.0 would mean two nodes train twice as fast; below it is what gloo's all-reduce of every "
    "gradient each step, and cores busy with other work (load_avg), cost. On a shared 2-core "
    "machine the two-worker run competes with everything else for both cores, the one-worker "
    "run for one. On GPU nodes (ray.use_gpu auto: one GPU per worker, NCCL) the same script "
    "measures GPU scaling; not measured here (no GPU)."
)


if __name__ == "__main__":
    main()
