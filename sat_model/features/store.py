"""The feature store: one Arrow IPC file per split, memory-mapped on read.

Dimensions: ``N`` images in the file, ``B`` batch, ``L`` locations, ``D`` annotation size.

Columns ``image_id: string`` and ``features: fixed_size_list<float16>[L*D]`` (row-major L×D);
schema metadata: the recorded fields of the encoder's
:class:`~sat_model.features.spec.EncoderSpec` (``name``, ``layer``, ``input_size``,
``num_locations``, ``annotation_dim``, ``grid_h``, ``grid_w``, ``weights_sha256``), then the
store's own ``format_version`` (docs/ARCHITECTURE.md).
:class:`FeatureWriter` appends record batches to a hidden temporary file and renames it on
success, so an interrupted run never leaves a file that looks complete. :class:`FeatureStore`
reads through ``pa.memory_map``: rows are numpy views into the mapping and the process never
copies the whole file into RAM.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa

from sat_model.atomic import fsync_dir, fsync_file, remove_dead_temps
from sat_model.features.spec import EncoderSpec

__all__ = [
    "FEATURES_FORMAT_VERSION",
    "MIRRORED_SUFFIX",
    "REPORT_FILE",
    "FeatureStore",
    "FeatureStoreError",
    "FeatureWriter",
    "channel_statistics",
    "store_file",
]

FEATURES_FORMAT_VERSION = 1
MIRRORED_SUFFIX = "_mirrored"  # a split's photos mirrored left to right: train_mirrored.arrow
REPORT_FILE = "extract_report.json"  # beside the stores: what the extract stage extracted


def store_file(split: str, *, mirrored: bool = False) -> str:
    """The file name of a split's store in the features folder: ``train.arrow``, or with
    ``mirrored`` the store of its photos mirrored, ``train_mirrored.arrow``."""
    return f"{split}{MIRRORED_SUFFIX if mirrored else ''}.arrow"


class FeatureStoreError(RuntimeError):
    """A feature file that is missing, truncated, corrupt or not a feature store."""


_FORMAT_KEY = "format_version"  # the store's, written after the spec's fields


def _schema(spec: EncoderSpec) -> pa.Schema:
    """The store's Arrow schema: the columns, the spec's fields and the format version as
    metadata (text, in this order: the file's bytes depend on it)."""
    metadata = {**spec.to_fields(), _FORMAT_KEY: FEATURES_FORMAT_VERSION}
    return pa.schema(
        [
            ("image_id", pa.string()),
            ("features", pa.list_(pa.float16(), spec.L * spec.D)),
        ],
        metadata={k.encode(): str(v).encode() for k, v in metadata.items()},
    )


def _read_metadata(metadata: dict[bytes, bytes] | None, path: Path) -> tuple[EncoderSpec, int]:
    """The encoder's spec and the format version a store's schema metadata records (stores
    without a version are version 1, the first)."""
    raw = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
    try:
        return EncoderSpec.from_fields(raw), int(raw.get(_FORMAT_KEY, 1))
    except KeyError as e:
        missing = e.args[0]
        raise FeatureStoreError(f"{path}: not a feature store (metadata lacks {missing!r})") from e
    except ValueError as e:
        raise FeatureStoreError(f"{path}: bad feature store metadata: {e}") from e


class FeatureWriter:
    """Write a feature store batch by batch; the file appears only when :meth:`close` succeeds.

    Use as a context manager: an exception inside the block deletes the temporary file.
    """

    def __init__(self, path: str | Path, spec: EncoderSpec) -> None:
        self.path = Path(path)
        self.spec = spec
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # .<name>.<pid>.partial of killed writers: never read, but they would waste disk and
        # end up inside DVC's hash of the folder
        remove_dead_temps(self.path.parent, self.path.name)
        # hidden, same folder (rename is atomic only within one file system)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        self._schema = _schema(spec)
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._writer = pa.ipc.new_file(self._sink, self._schema)
        self.rows = 0

    def write(self, image_ids: list[str], features: np.ndarray) -> None:
        """Append ``features`` (B, L, D) for ``image_ids`` (B); stored as float16."""
        expected = (len(image_ids), self.spec.L, self.spec.D)
        if features.shape != expected:
            raise ValueError(f"features shape {features.shape} != expected {expected}")
        flat = np.ascontiguousarray(features, dtype=np.float16).reshape(-1)  # (B·L·D,)
        column = pa.FixedSizeListArray.from_arrays(pa.array(flat), self.spec.L * self.spec.D)
        batch = pa.record_batch([pa.array(image_ids, pa.string()), column], schema=self._schema)
        self._writer.write_batch(batch)
        self.rows += len(image_ids)

    def close(self) -> Path:
        self._writer.close()
        self._sink.close()
        fsync_file(self._tmp)  # the data on disk before the rename makes it the store
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self._sink.close()
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class FeatureStore:
    """Read-only, memory-mapped access to one split's features."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FeatureStoreError(f"feature file not found: {self.path}")
        try:
            self._source = pa.memory_map(str(self.path), "r")
            reader = pa.ipc.open_file(self._source)
            self.spec, self.format_version = _read_metadata(reader.schema.metadata, self.path)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise FeatureStoreError(
                f"feature file {self.path} is truncated or corrupt ({type(e).__name__}: {e}); "
                "run the extract stage again"
            ) from e
        self._blocks = [self._block_view(b) for b in batches]  # views, (n_b, L, D) each
        sizes = [len(b) for b in batches]
        self._starts = np.cumsum([0, *sizes])  # (num_batches + 1,)
        self.ids: list[str] = [i for b in batches for i in b.column(0).to_pylist()]
        self._index = {image_id: i for i, image_id in enumerate(self.ids)}

    def _block_view(self, batch: pa.RecordBatch) -> np.ndarray:
        column = batch.column(1)
        if column.null_count:
            raise FeatureStoreError(f"{self.path}: features column holds nulls")
        values = column.flatten().to_numpy(zero_copy_only=True)  # (n_b·L·D,) float16 view
        view: np.ndarray = values.reshape(len(batch), self.spec.L, self.spec.D)  # (n_b, L, D)
        return view

    def __len__(self) -> int:
        return len(self.ids)

    def index_of(self, image_id: str) -> int:
        try:
            return self._index[image_id]
        except KeyError:
            raise KeyError(f"image id {image_id!r} not in {self.path}") from None

    def __getitem__(self, i: int) -> np.ndarray:
        """Features of row ``i``: (L, D) float16, a read-only view into the mapping."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows in {self.path}")
        i = i % n
        block = int(np.searchsorted(self._starts, i, side="right")) - 1
        row: np.ndarray = self._blocks[block][i - self._starts[block]]
        return row

    def get_batch(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """Rows ``indices`` gathered into a new (B, L, D) float16 array."""
        out = np.empty((len(indices), self.spec.L, self.spec.D), dtype=np.float16)
        for j, i in enumerate(indices):
            out[j] = self[int(i)]
        return out

    def close(self) -> None:
        self._blocks = []
        self._source.close()


def channel_statistics(
    store: FeatureStore, max_images: int = 1000, chunk: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation (D,) over every location of up to ``max_images``
    images spread evenly over the store, accumulated in float64 (deterministic for a store)."""
    if len(store) == 0:
        raise ValueError(f"{store.path}: no features to compute statistics from")
    rows = np.unique(np.linspace(0, len(store) - 1, min(max_images, len(store))).round())
    total = np.zeros(store.spec.D)
    squares = np.zeros(store.spec.D)
    for start in range(0, len(rows), chunk):
        block = store.get_batch(rows[start : start + chunk].astype(int)).astype(np.float64)
        flat = block.reshape(-1, block.shape[-1])  # (B*L, D)
        total += flat.sum(0)
        squares += (flat * flat).sum(0)
    count = len(rows) * store.spec.L
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return mean.astype(np.float32), std.astype(np.float32)
