"""``sat caption SOURCE --engine ray --out DEST``: a folder or a bucket captioned by Ray Data.

Ray Data reads the image files of SOURCE (a folder, or an object-store prefix such as
``s3://bucket/photos``: anything ``pyarrow.fs`` opens, credentials and endpoint from the AWS
variables) as bytes, streams them to a pool of actors that each hold the model once, and writes
one row per file to DEST as JSON lines or Parquet: ``path``, ``caption``, ``error`` (null
unless that file is not a usable image), and ``drift`` and ``drifted``: how far the photo's
features are from the training photos' and whether past the model's threshold
(:mod:`sat_model.features.drift`; null when the model records no statistics). The model's
checkpoint travels through Ray's object store, so no node needs the driver's files. Each
image's bytes become the encoder's pixels through
:meth:`sat_model.features.images.Preprocessing.pixels`, the path ``sat caption`` takes in one
process, so both give the same captions with the same model and beam. A bad image is a row
with its reason, never a failed job; a worker that dies has its blocks run again by Ray
Data, which writes each output block once.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.ray.runtime import without_core_lines

__all__ = ["BatchCaptionResult", "caption_with_ray_data", "check_destination"]

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
# a read task fetches bytes only: it reserves a quarter of a CPU, and an actor the rest of its
# node, whose cores its threads keep busy (decoding, the encoder, the beam search)
READ_CPUS = 0.25
CALLS_PER_ACTOR = 2  # one decoding its batch while the other runs the model (_CaptionActor)
# Ray core's line for every actor pool of Ray Data (its own arguments are in the object store)
RAY_DATA_RESTART_WARNING = "has constructor arguments in the object store and max_restarts > 0"
OUTPUT_FILE = re.compile(r"captions_\d{6}(-\d+)?\.(json|parquet)")  # written by _output_names


@dataclass(frozen=True)
class BatchCaptionResult:
    rows: int
    errors: int
    out: str
    drifted: int | None = None  # photos past the drift threshold; None: the model has no record


class _CaptionActor:
    """One copy of the model per actor; a batch of files in, a row per file out.

    Ray Data makes two calls at once (``CALLS_PER_ACTOR``): one decodes its batch (Pillow frees
    the GIL) while the other runs the model, which one call at a time holds (``self.model``), as
    ``sat caption`` decodes the next batch while it captions this one.
    """

    def __init__(
        self, checkpoint: list[Any], options: Mapping[str, Any], max_pixels: int, threads: int
    ) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        import ray
        import torch

        from sat_model.captioner import Captioner

        torch.set_num_threads(threads)
        self.pool = ThreadPoolExecutor(max_workers=threads)  # decoding
        self.model = threading.Lock()
        with tempfile.TemporaryDirectory(prefix="sat-caption-") as tmp:
            for name, data in ray.get(checkpoint[0]).items():
                (Path(tmp) / name).write_bytes(data)
            self.captioner = Captioner.from_dir(tmp, **options)
        self.preprocessing = replace(self.captioner.preprocessing, max_pixels=max_pixels)

    def _decode(self, data: Any) -> Any:
        """One file's bytes as the encoder's pixels (the path every photo takes), or the
        ImageError why not."""
        from sat_model.features.images import ImageError

        try:
            return self.preprocessing.pixels(bytes(data), label="<file>")
        except ImageError as e:
            return e

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        import torch

        from sat_model.features.images import ImageError

        paths = [str(p) for p in batch["path"]]
        decoded = list(self.pool.map(self._decode, batch["bytes"]))
        images = {i: d for i, d in enumerate(decoded) if not isinstance(d, ImageError)}
        errors = {i: d.reason for i, d in enumerate(decoded) if isinstance(d, ImageError)}
        with self.model:
            found = (
                self.captioner.caption_pixels(torch.stack(list(images.values()))) if images else []
            )
            captions = dict(zip(images, found, strict=True))
        return {
            "path": paths,
            "caption": [captions[i].text if i in captions else None for i in range(len(paths))],
            "error": [errors.get(i) for i in range(len(paths))],
            **_drift_columns([captions.get(i) for i in range(len(paths))]),
        }


def _drift_columns(captions: list[Any]) -> dict[str, list[Any]]:
    """The ``drift`` and ``drifted`` columns of a batch (null where a row has no score)."""
    from sat_model.features.drift import drift_fields

    rows = [drift_fields(c.drift if c is not None else None) for c in captions]
    return {"drift": [r["drift"] for r in rows], "drifted": [r["drifted"] for r in rows]}


def _output_names() -> type:
    """Ray Data's ``FilenameProvider`` naming output files ``captions_000000.json`` … by the
    write task's index, the same names on every run (Ray's own begin with a random id)."""
    from ray.data.datasource import FilenameProvider

    class OutputNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"captions_{task_index:06}.{self.file_format}"

    return OutputNames


def check_destination(out: str) -> None:
    """``FileExistsError`` unless ``out`` is absent or holds only an earlier run's output files
    (``captions_NNNNNN.json``, ``captions_NNNNNN-N.parquet``): those are replaced, nothing else
    ever is."""
    import pyarrow.fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(out)
    found = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    foreign = [f.base_name for f in found if not OUTPUT_FILE.fullmatch(f.base_name)]
    if foreign:
        raise FileExistsError(
            f"refusing to write captions into {out}: it holds other files ({foreign[0]}, ...); "
            "name a new folder or prefix with --out"
        )


def _actor_cpus(actors: int) -> float:
    """What each actor reserves: the CPUs of the smallest live node but a read task's share,
    split among the actors that node holds when they are spread evenly over the nodes."""
    import ray

    cpus = [c for n in ray.nodes() if n["Alive"] and (c := n["Resources"].get("CPU", 0.0)) > 0]
    per_node = math.ceil(actors / len(cpus))
    return max((min(cpus) - READ_CPUS) / per_node, READ_CPUS)


def _captioned(
    files: Any,
    checkpoint_dir: Path,
    options: Mapping[str, Any],
    max_pixels: int,
    actors: int,
    cpus: float,
) -> Any:
    """``files`` (Ray Data's path and bytes rows) through the pool of :class:`_CaptionActor`,
    each reserving ``cpus``: a lazy dataset of path, caption and error rows."""
    import ray
    import ray.data

    from sat_model.model.checkpoint import model_files

    checkpoint = {
        name: (checkpoint_dir / name).read_bytes() for name in model_files(checkpoint_dir)
    }
    return files.map_batches(
        _CaptionActor,
        fn_constructor_kwargs={
            # in the object store once, fetched by each actor (and by a restarted one: the
            # reference, held here, keeps it alive while the job runs)
            "checkpoint": [ray.put(checkpoint)],
            "options": dict(options),
            "max_pixels": max_pixels,
            "threads": max(1, math.ceil(cpus)),
        },
        batch_size=int(options.get("batch_size", 16)),
        compute=ray.data.ActorPoolStrategy(
            size=actors,
            max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
            enable_true_multi_threading=True,
        ),
        num_cpus=cpus,
    )


def caption_with_ray_data(
    source: str,
    out: str,
    checkpoint_dir: Path,
    options: Mapping[str, Any],
    *,
    max_pixels: int,
    fmt: str = "jsonl",
    actors: int = 1,
    cpus_per_actor: float | None = None,
) -> BatchCaptionResult:
    """Caption every image file under ``source`` into ``out`` on the connected Ray cluster.

    ``options`` are :class:`~sat_model.captioner.Captioner` options (beam, batch size, decoding);
    ``max_pixels`` the decompression-bomb limit of one image. ``cpus_per_actor`` (default: a
    node's CPUs but a read task's share, shared by the actors a node holds) is what each actor
    reserves, and as many threads decode its photos and run its model.
    """
    import logging

    import ray.data
    from ray.data import SaveMode

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # a plan and a report per dataset
    # "Replacing contents" of --out: only an earlier run's files, checked before
    logging.getLogger("ray.data.datasource.file_datasink").setLevel(logging.ERROR)

    files = ray.data.read_binary_files(
        source,
        include_paths=True,
        file_extensions=list(IMAGE_SUFFIXES),
        num_cpus=READ_CPUS,
    )
    cpus = cpus_per_actor if cpus_per_actor is not None else _actor_cpus(actors)
    check_destination(out)
    # the names are the same on every run, so an earlier run's files are replaced, not added to
    names = _output_names()(file_format="parquet" if fmt == "parquet" else "json")
    with without_core_lines(RAY_DATA_RESTART_WARNING):
        rows = _captioned(files, checkpoint_dir, options, max_pixels, actors, cpus).materialize()
        if fmt == "parquet":
            rows.write_parquet(out, filename_provider=names, mode=SaveMode.OVERWRITE)
        else:
            rows.write_json(out, filename_provider=names, mode=SaveMode.OVERWRITE)
    errors = rows.filter(lambda row: row["error"] is not None).count()
    scored = rows.filter(lambda row: row["drifted"] is not None).count()
    drifted = rows.filter(lambda row: row["drifted"] is True).count() if scored else None
    return BatchCaptionResult(rows=rows.count(), errors=errors, out=out, drifted=drifted)
