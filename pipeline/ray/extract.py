"""The ``engine: ray`` extraction: the same batches as the local engine, encoded by Ray Data actors.

A split's image list is cut into the fixed ``batch_slices`` of ``sat_model.features.extract``; each
slice is
one Ray Data row, and ``map_batches`` (``batch_size=1``) hands rows to a pool of actors that each
hold one frozen encoder. The driver receives the float16 features in slice order
(``preserve_order``) and writes the store itself, incrementally and atomically, so the file is
byte-identical to the local engine's on the same input (same slices, same torch thread count; on
GPU actors the float16 values may differ in the last bit from a CPU run).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sat_model.features.encoders import Encoder, rebuild_encoder
from sat_model.features.extract import (
    DecodedBatch,
    ImageItem,
    SplitResult,
    batch_slices,
    decode_batch,
    encode_batch,
)
from sat_model.features.images import Preprocessing
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureWriter

__all__ = ["RaySplitRunner"]


class _BatchEncoder:
    """Ray Data actor: decode one batch slice and encode it (rows in, rows out)."""

    def __init__(
        self,
        spec: EncoderSpec,
        weights: str | None,
        prep: Preprocessing,
        use_gpu: bool,
        torch_threads: int,
    ) -> None:
        # the same thread count as the local engine: CPU kernels' float results depend on it
        torch.set_num_threads(torch_threads)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # the driver's encoder, checked: another weights file on this node is refused
        self.encoder = rebuild_encoder(spec, weights).to(self.device)
        self.prep = prep

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, list[Any]] = {"batch_index": [], "ids": [], "skipped": [], "features": []}
        for index, items_json in zip(rows["batch_index"], rows["items"], strict=True):
            items = [ImageItem(*pair) for pair in json.loads(items_json)]
            batch = decode_batch(items, self.prep)
            features = self._encode(batch)  # (B_ok, L, D) float16
            out["batch_index"].append(int(index))
            out["ids"].append(json.dumps(batch.image_ids))
            out["skipped"].append(json.dumps(batch.skipped))
            out["features"].append(features.tobytes())
        return {k: np.array(v, dtype=object) for k, v in out.items()}

    def _encode(self, batch: DecodedBatch) -> np.ndarray:
        if not batch.image_ids:
            return np.empty(0, dtype=np.float16)
        return encode_batch(self.encoder, batch.images.to(self.device))


class RaySplitRunner:
    """A drop-in for ``sat_model.features.extract.extract_split`` running on the current Ray
    cluster.

    Ray must already be initialised (``pipeline.ray.runtime.ray_session``).
    """

    def __init__(
        self, weights: str | None, num_actors: int, use_gpu: bool, torch_threads: int
    ) -> None:
        # the driver's encoder's weights file, absolute: actors do not share its directory
        self.weights = weights
        self.num_actors = num_actors
        self.use_gpu = use_gpu
        self.torch_threads = torch_threads

    def __call__(
        self,
        encoder: Encoder,
        items: list[ImageItem],
        out_path: str | Path,
        prep: Preprocessing,
        batch_size: int,
        num_workers: int,
        split: str = "",
        progress: bool = True,
    ) -> SplitResult:
        del num_workers  # decoding happens inside the actors
        start = time.perf_counter()
        rows = self._dataset(encoder.spec, items, prep, batch_size).iter_rows()
        skipped: list[tuple[str, str]] = []
        bar = tqdm(
            total=len(items),
            desc=f"extract {split} (ray)",
            unit="img",
            disable=None if progress else True,  # None: a bar on a terminal only, not in logs
        )
        spec = encoder.spec
        with FeatureWriter(out_path, spec) as writer, bar:
            for index, row in enumerate(rows):
                if row["batch_index"] != index:
                    raise RuntimeError(f"Ray returned batch {row['batch_index']}, expected {index}")
                ids = json.loads(row["ids"])
                if ids:
                    flat = np.frombuffer(row["features"], dtype=np.float16)
                    writer.write(ids, flat.reshape(len(ids), spec.L, spec.D))  # (B_ok, L, D)
                skipped.extend((i, r) for i, r in json.loads(row["skipped"]))
                bar.update(len(ids) + len(json.loads(row["skipped"])))
        return SplitResult(split, str(out_path), writer.rows, skipped, time.perf_counter() - start)

    def _dataset(
        self, spec: EncoderSpec, items: list[ImageItem], prep: Preprocessing, batch_size: int
    ) -> Any:
        import ray

        ray.data.DataContext.get_current().execution_options.preserve_order = True
        slices = batch_slices(len(items), batch_size)
        rows = [
            {
                "batch_index": k,
                "items": json.dumps([[i.image_id, i.path, i.refused] for i in items[s]]),
            }
            for k, s in enumerate(slices)
        ]
        ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 64)))
        return ds.map_batches(
            _BatchEncoder,
            fn_constructor_kwargs={
                "spec": spec,
                "weights": self.weights,
                "prep": prep,
                "use_gpu": self.use_gpu,
                "torch_threads": self.torch_threads,
            },
            batch_size=1,  # one row is one whole batch slice
            concurrency=max(1, min(self.num_actors, len(rows))),  # no idle actors
            num_cpus=self.torch_threads,
            num_gpus=1 if self.use_gpu else None,
        )
