"""Caption minibatches over a feature store, grouped by caption length and shardable.

Dimensions (docs/METHOD.md): ``B`` batch, ``T`` caption steps (``T+1`` tokens with ``<start>``),
``L`` annotation locations, ``D`` annotation size.

The paper trains on minibatches of one caption length (Sec. 4.3), so no compute is spent on
padding. Every epoch is a full pass: captions shuffled within each length, cut into batches of
one length, the list shuffled, all from ``(seed, epoch)`` so every rank computes the same list
without talking. Rank ``r`` of ``R`` takes every ``R``-th batch, the largest halved until the
count divides, so shards are disjoint, complete and equal in count (DDP needs the same steps).
Annotations are read from the memory-mapped store one batch at a time. Mirroring
(``train.mirror``, beyond the paper) pairs a share of the captions, drawn from ``(seed,
epoch)``, with their photo's mirrored features, "left" and "right" swapped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from sat_model.data.tables import read_caption_rows
from sat_model.data.vocab import Vocab

__all__ = [
    "Batch",
    "BatchingError",
    "CaptionDataset",
    "FeatureSource",
    "LengthGroupedBatchSampler",
    "MirroredView",
    "SkippedCaption",
    "load_caption_dataset",
    "mirror_draws",
    "mirror_tokens",
    "split_to_multiple",
]

# the words a mirror image turns into each other (a caption's other words describe both)
MIRROR_SWAPS = {"left": "right", "right": "left"}


class BatchingError(ValueError):
    """No usable caption is left, or batching arguments are invalid; names the bad value."""


class FeatureSource(Protocol):
    """What batching needs of ``sat_model.features.store.FeatureStore`` (ARCHITECTURE.md)."""

    @property
    def ids(self) -> Sequence[str]: ...

    def get_batch(self, indices: Sequence[int]) -> np.ndarray: ...


@dataclass(frozen=True)
class SkippedCaption:
    """A caption left out of a dataset, with the reason: never silently dropped."""

    image_id: str
    caption_index: int
    reason: str


@dataclass(frozen=True)
class Batch:
    """One minibatch in the model's caption layout (ARCHITECTURE.md, "Model contracts")."""

    annotations: torch.Tensor  # (B, L, D) float32
    captions: torch.Tensor  # (B, T+1) long: <start> w_1 .. w_k <end> <pad>..
    lengths: torch.Tensor  # (B,) long, k+2
    image_indices: torch.Tensor  # (B,) long, rows of the feature store

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.annotations.to(device, non_blocking=True),
            self.captions.to(device, non_blocking=True),
            self.lengths.to(device, non_blocking=True),
            self.image_indices.to(device, non_blocking=True),
        )


@dataclass(frozen=True)
class MirroredView:
    """A dataset's photos mirrored left to right: their store (the same rows as the dataset's
    store) and each caption's ids with "left" and "right" swapped (the same lengths)."""

    store: FeatureSource
    captions: list[tuple[int, ...]]


class CaptionDataset:
    """(feature-store row, caption ids) pairs of one split; ``collate`` builds a :class:`Batch`."""

    def __init__(
        self,
        store: FeatureSource,
        image_indices: Sequence[int],
        captions: Sequence[Sequence[int]],
        pad_id: int = 0,
        mirrored: MirroredView | None = None,
    ) -> None:
        if len(image_indices) != len(captions):
            raise BatchingError(f"{len(image_indices)} image indices but {len(captions)} captions")
        if not captions:
            raise BatchingError("a caption dataset needs at least one caption")
        if mirrored is not None and len(mirrored.captions) != len(captions):
            raise BatchingError(f"{len(mirrored.captions)} mirrored captions for {len(captions)}")
        self.store = store
        self.image_indices = np.asarray(image_indices, dtype=np.int64)  # (N,)
        self.captions = [tuple(int(t) for t in c) for c in captions]
        self.lengths = np.array([len(c) for c in self.captions], dtype=np.int64)  # (N,)
        self.pad_id = pad_id
        self.mirrored = mirrored

    def __len__(self) -> int:
        return len(self.captions)

    def collate(
        self, indices: Sequence[int], mirror: Sequence[bool] | np.ndarray | None = None
    ) -> Batch:
        """Annotations and padded captions of dataset items ``indices``; where ``mirror[j]`` is
        true, item ``indices[j]`` comes mirrored (needs the dataset's :class:`MirroredView`)."""
        items = np.asarray(indices, dtype=np.int64)  # (B,)
        rows = self.image_indices[items]  # (B,)
        flip = np.zeros(len(items), dtype=bool) if mirror is None else np.asarray(mirror, bool)
        if flip.any() and self.mirrored is None:
            raise BatchingError("mirrored items asked of a dataset built without mirrored photos")
        # (B, L, D) float16 from the mappings; each row read from one store only
        feats = self.store.get_batch(rows[~flip].tolist())
        if flip.any():
            assert self.mirrored is not None
            both = np.empty((len(items), *feats.shape[1:]), dtype=feats.dtype)
            both[~flip] = feats
            both[flip] = self.mirrored.store.get_batch(rows[flip].tolist())
            feats = both
        # torch's float16 conversion is vectorised, numpy's astype is not
        annotations = torch.from_numpy(feats).to(torch.float32)  # (B, L, D)
        lengths = torch.as_tensor(self.lengths[items])  # (B,)
        captions = torch.full((len(items), int(lengths.max())), self.pad_id, dtype=torch.long)
        for row, (i, flipped) in enumerate(zip(items.tolist(), flip.tolist(), strict=True)):
            tokens = self.mirrored.captions[i] if flipped and self.mirrored else self.captions[i]
            captions[row, : len(tokens)] = torch.as_tensor(tokens)  # (B, T+1)
        return Batch(annotations, captions, lengths, torch.from_numpy(rows))


def mirror_tokens(tokens: Sequence[str]) -> list[str]:
    """A caption of the photo mirrored left to right: "left" and "right" swapped."""
    return [MIRROR_SWAPS.get(t, t) for t in tokens]


def mirror_draws(count: int, p: float, seed: int, epoch: int) -> np.ndarray:
    """Which of ``count`` items an epoch mirrors, each with chance ``p``: (count,) bool, from
    ``(seed, epoch)`` alone (a stream apart from the batch order's)."""
    return np.random.default_rng([seed, epoch, 1]).random(count) < p


def load_caption_dataset(
    captions_path: str | Path,
    split: str,
    store: FeatureSource,
    vocab: Vocab,
    mirrored_store: FeatureSource | None = None,
) -> tuple[CaptionDataset, list[SkippedCaption]]:
    """The ``split`` captions of ``captions.parquet`` whose image is in ``store``, with their
    mirrored view when ``mirrored_store`` (the same photos mirrored, row for row) is given.

    Captions whose image has no features (the extract stage skipped it) are returned as
    :class:`SkippedCaption`; :class:`BatchingError` only when none is left, or when
    ``mirrored_store`` does not hold ``store``'s images in its order.
    """
    if mirrored_store is not None and list(mirrored_store.ids) != list(store.ids):
        raise BatchingError(
            "the mirrored feature store does not hold the same images in the same order as the "
            "train store: re-run the extract stage"
        )
    rows = read_caption_rows(captions_path, split, ["image_id", "caption_index", "tokens"])
    row_of = {image_id: i for i, image_id in enumerate(store.ids)}
    indices, captions, mirrored, skipped = [], [], [], []
    for image_id, cap_idx, tokens in zip(
        rows["image_id"], rows["caption_index"], rows["tokens"], strict=True
    ):
        if image_id not in row_of:
            skipped.append(SkippedCaption(image_id, cap_idx, "image has no features"))
            continue
        indices.append(row_of[image_id])
        captions.append(vocab.encode_caption(tokens))
        if mirrored_store is not None:
            mirrored.append(tuple(vocab.encode_caption(mirror_tokens(tokens))))
    if not captions:
        raise BatchingError(
            f"no usable {split!r} caption in {captions_path}: "
            f"{len(skipped)} skipped (e.g. {[s.image_id for s in skipped[:3]]})"
        )
    view = None if mirrored_store is None else MirroredView(mirrored_store, mirrored)
    return CaptionDataset(store, indices, captions, vocab.pad_id, view), skipped


class LengthGroupedBatchSampler:
    """Per-epoch batches of equal-length captions, sharded over ``num_replicas`` ranks.

    ``batches(epoch)`` is this rank's list; ``global_batches(epoch)`` the list all ranks share.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_size < 1:
            raise BatchingError(f"batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise BatchingError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.lengths = np.asarray(lengths, dtype=np.int64)  # (N,)
        if self.lengths.size == 0:
            raise BatchingError("no caption to batch")
        self.batch_size = batch_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``iter``/``len`` use (as torch's DistributedSampler)."""
        self.epoch = epoch

    def global_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches, interleaved: rank r owns positions r, r+R, r+2R, ..."""
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for length in np.unique(self.lengths):  # sorted, so the rng draws in a fixed order
            members = rng.permutation(np.flatnonzero(self.lengths == length))
            batches += [
                members[i : i + self.batch_size].tolist()
                for i in range(0, members.size, self.batch_size)
            ]
        batches = split_to_multiple(batches, self.num_replicas)
        order = rng.permutation(len(batches))
        return [batches[i] for i in order]

    def batches(self, epoch: int) -> list[list[int]]:
        return self.global_batches(epoch)[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches(self.epoch))


def split_to_multiple(batches: list[list[int]], multiple: int) -> list[list[int]]:
    """Halve the largest batches until the count is a multiple of ``multiple``.

    Halving keeps a batch homogeneous in length and every caption in exactly one batch. Only
    when there are fewer captions than the next multiple (a toy dataset) are whole batches
    repeated, as torch's DistributedSampler pads, so that every rank still steps equally.
    """
    batches = list(batches)
    while len(batches) % multiple:
        largest = max(range(len(batches)), key=lambda i: (len(batches[i]), -i))
        big = batches[largest]
        if len(big) < 2:
            need = multiple - len(batches) % multiple
            return batches + [batches[i % len(batches)] for i in range(need)]
        half = (len(big) + 1) // 2
        batches[largest : largest + 1] = [big[:half], big[half:]]
    return batches
