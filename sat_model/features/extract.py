"""Feature extraction: prepared image table → one feature store per split.

Dimensions: ``B`` batch, ``S`` crop size, ``L`` locations, ``D`` annotation size.

Images decode in DataLoader worker processes (JPEG decode, resize and crop to uint8 pixels: PIL
does the work, one torch thread each) while the main process normalises each batch at once and
runs the frozen encoder under ``torch.inference_mode``, so decoding overlaps the forward pass.
A batch is always the same slice of a split's image list (``batch_slices``), with the images that
fail to decode removed, so any engine that follows the same slicing (``pipeline.ray.extract``)
produces byte-identical stores. Undecodable images are skipped with their reason; extraction
fails only when no image at all could be extracted.

With ``encoder.mirror_train`` the train split is extracted a second time from its photos
mirrored left to right, into ``train_mirrored.arrow`` (same rows, same order): training augmentation
(``train.mirror``). The encoder sees the mirrored photo itself; the mirrored grid of the
original's features is no stand-in for it (docs/METHOD.md, "Training").
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from sat_model.config import EncoderConfig
from sat_model.data.tables import TableError, read_images, split_order
from sat_model.features.encoders import Encoder
from sat_model.features.images import ImageError, Preprocessing
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import MIRRORED_SUFFIX, FeatureWriter, store_file

__all__ = [
    "DecodedBatch",
    "ExtractError",
    "ExtractReport",
    "ImageItem",
    "SplitResult",
    "batch_slices",
    "decode_batch",
    "encode_batch",
    "extract_features",
    "extract_split",
    "read_image_table",
]


class ExtractError(RuntimeError):
    """Nothing usable to extract, or an unreadable image table."""


@dataclass(frozen=True)
class ImageItem:
    image_id: str
    path: str  # absolute: Ray workers do not share the driver's working directory
    refused: str = ""  # why the file is never opened (a path outside the image root), or ""


@dataclass(frozen=True)
class DecodedBatch:
    """The decodable part of one batch slice, plus the reasons for the rest."""

    image_ids: list[str]
    images: torch.Tensor  # (B_ok, 3, S, S) uint8 pixels, not yet normalised
    skipped: list[tuple[str, str]]  # (image_id, reason)


@dataclass(frozen=True)
class SplitResult:
    split: str
    path: str
    extracted: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (image_id, reason)
    seconds: float = 0.0


@dataclass(frozen=True)
class ExtractReport:
    engine: str
    encoder: EncoderSpec  # the built encoder's: normalisation known
    splits: list[SplitResult]
    seconds: float

    def to_dict(self) -> dict[str, object]:
        """Flat, stable keys for ``dvc metrics``, then the skipped list and the encoder: what
        was extracted, the same for the same photos and encoder, so a re-run that writes the
        same stores leaves the features' hash (and the trainings after it) as they were. How
        the run went (engine, seconds) is :meth:`timing`."""
        out: dict[str, object] = {
            "images_extracted": self.extracted,
            "images_skipped": sum(len(s.skipped) for s in self.splits),
        }
        for s in self.splits:
            out[f"extracted_{s.split}"] = s.extracted
            out[f"skipped_{s.split}"] = len(s.skipped)
        out["skipped"] = [
            {"item": image_id, "split": s.split, "reason": reason}
            for s in self.splits
            for image_id, reason in s.skipped
        ]
        mean, std = self.encoder.normalization()
        out["encoder"] = {**self.encoder.to_fields(), "mean": mean, "std": std}
        return out

    @property
    def extracted(self) -> int:
        return sum(s.extracted for s in self.splits)

    def timing(self) -> dict[str, object]:
        """The engine and the rate of this run, which differ between runs of the same
        extraction: kept apart from :meth:`to_dict`."""
        return {
            "engine": self.engine,
            "images_extracted": self.extracted,
            "seconds": round(self.seconds, 3),
            "images_per_s": round(self.extracted / self.seconds, 2) if self.seconds > 0 else 0.0,
        }

    def skipped_summary(self, examples: int = 3) -> str:
        """The skipped images in one short line: how many, each reason with its count, and the
        first few of them (the full list is ``to_dict()["skipped"]``, thousands of entries when
        a whole folder is missing)."""
        skipped = [(s.split, item, reason) for s in self.splits for item, reason in s.skipped]
        total = len(skipped) + sum(s.extracted for s in self.splits)
        reasons = Counter(reason for _, _, reason in skipped)
        counted = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common())
        first = ", ".join(f"{split}/{image_id}" for split, image_id, _ in skipped[:examples])
        more = ", ..." if len(skipped) > examples else ""
        return f"{len(skipped)} of {total} images skipped: {counted}; first: {first}{more}"


def read_image_table(path: str | Path, image_root: str | Path) -> dict[str, list[ImageItem]]:
    """Images with ``status == "ok"`` per split, in table order (:mod:`sat_model.data.tables`).

    A name that leaves ``image_root`` is never opened: its item carries the reason and is
    skipped.
    """
    try:
        records = read_images(path, image_root)
    except TableError as e:
        raise ExtractError(str(e)) from e
    items: dict[str, list[ImageItem]] = {}
    for r in records:
        items.setdefault(r.split, []).append(ImageItem(r.image_id, str(r.path), r.refused))
    return {s: items[s] for s in sorted(items, key=split_order)}


def batch_slices(count: int, batch_size: int) -> list[slice]:
    """The fixed batch boundaries every engine uses (outputs depend on batch composition)."""
    return [slice(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def decode_batch(items: Sequence[ImageItem], prep: Preprocessing) -> DecodedBatch:
    samples = [_decode_one(item, prep) for item in items]
    return collate_samples(samples, prep.crop)


def _decode_one(item: ImageItem, prep: Preprocessing) -> tuple[str, torch.Tensor | None, str]:
    if item.refused:
        return item.image_id, None, item.refused
    try:
        return item.image_id, prep.pixels(item.path), ""
    except ImageError as e:
        return item.image_id, None, e.reason


def collate_samples(samples: list[tuple[str, torch.Tensor | None, str]], crop: int) -> DecodedBatch:
    ok = [(image_id, x) for image_id, x, _ in samples if x is not None]
    skipped = [(image_id, reason) for image_id, x, reason in samples if x is None]
    images = torch.stack([x for _, x in ok]) if ok else torch.empty(0, 3, crop, crop).byte()
    return DecodedBatch([image_id for image_id, _ in ok], images, skipped)  # images (B_ok,3,S,S)


def encode_batch(encoder: Encoder, images: torch.Tensor) -> np.ndarray:
    """Annotations (B, L, D) as float16 (the store's dtype) of uint8 ``images`` (B, 3, S, S)."""
    half: np.ndarray = encoder.annotate(images).cpu().numpy()  # (B, L, D) float16
    return half


class _DecodeDataset(Dataset[tuple[str, torch.Tensor | None, str]]):
    def __init__(self, items: Sequence[ImageItem], prep: Preprocessing) -> None:
        self.items = items
        self.prep = prep

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor | None, str]:
        return _decode_one(self.items[i], self.prep)


class _Collate:
    def __init__(self, crop: int) -> None:
        self.crop = crop

    def __call__(self, samples: list[tuple[str, torch.Tensor | None, str]]) -> DecodedBatch:
        return collate_samples(samples, self.crop)


def _single_thread_worker(_: int) -> None:
    # decoding workers share the cores with the encoder; torch ops in them stay single-threaded
    torch.set_num_threads(1)


def iter_decoded(
    items: Sequence[ImageItem], prep: Preprocessing, batch_size: int, num_workers: int
) -> Iterator[DecodedBatch]:
    """Decoded batches in ``batch_slices`` order, decoding ahead in worker processes."""
    loader = DataLoader(
        _DecodeDataset(items, prep),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_Collate(prep.crop),
        worker_init_fn=_single_thread_worker if num_workers else None,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=False,
    )
    yield from loader


def extract_split(
    encoder: Encoder,
    items: Sequence[ImageItem],
    out_path: str | Path,
    prep: Preprocessing,
    batch_size: int,
    num_workers: int,
    split: str = "",
    progress: bool = True,
) -> SplitResult:
    """Encode ``items`` into the feature store ``out_path`` (written atomically)."""
    start = time.perf_counter()
    skipped: list[tuple[str, str]] = []
    # disable=None: a bar on a terminal only; a log (DVC's, a CI job's) gets the stage's line
    bar = tqdm(
        total=len(items), desc=f"extract {split}", unit="img", disable=None if progress else True
    )
    with (
        FeatureWriter(out_path, encoder.spec) as writer,
        bar,
    ):
        for batch in iter_decoded(items, prep, batch_size, num_workers):
            if batch.image_ids:
                writer.write(batch.image_ids, encode_batch(encoder, batch.images))
            skipped.extend(batch.skipped)
            bar.update(len(batch.image_ids) + len(batch.skipped))
    return SplitResult(split, str(out_path), writer.rows, skipped, time.perf_counter() - start)


def extract_features(
    images_table: str | Path,
    image_root: str | Path,
    out_dir: str | Path,
    encoder: Encoder,
    settings: EncoderConfig,
    *,
    progress: bool = True,
    run_split: Callable[..., SplitResult] | None = None,
) -> ExtractReport:
    """Extract every split of ``images_table`` (names under ``image_root``) into
    ``out_dir/{split}.arrow`` as ``settings`` (``params.encoder``: resize, crop, batch size,
    decoding workers, pixel guard, engine) say, and with ``mirror_train`` the train split
    mirrored into ``out_dir/train_mirrored.arrow``.

    ``run_split`` replaces :func:`extract_split` (same keyword arguments): the Ray engine plugs
    in here so both engines share table reading, preprocessing and reporting.

    Raises:
        ExtractError: the table holds no usable image, or none could be extracted.
    """
    s = settings
    if s.crop != encoder.spec.input_size:
        raise ValueError(f"crop {s.crop} != encoder input size {encoder.spec.input_size}")
    splits = read_image_table(images_table, image_root)
    if not splits:
        raise ExtractError(f"{images_table} holds no image with status 'ok' in a split")
    prep = Preprocessing(s.resize, s.crop, s.max_image_pixels, keep_aspect=s.keep_aspect)
    jobs = [(split, items, prep) for split, items in splits.items()]
    jobs += [
        (split + MIRRORED_SUFFIX, splits[split], replace(prep, mirror=True))
        for split in (["train"] if s.mirror_train else [])
        if split in splits
    ]
    run = run_split or extract_split
    start = time.perf_counter()
    results = [
        run(
            encoder=encoder,
            items=items,
            out_path=Path(out_dir) / store_file(split),
            prep=split_prep,
            batch_size=s.batch_size,
            num_workers=s.num_workers,
            split=split,
            progress=progress,
        )
        for split, items, split_prep in jobs
    ]
    report = ExtractReport(s.engine, encoder.spec, results, time.perf_counter() - start)
    if not any(r.extracted for r in results):
        raise ExtractError(
            f"no image could be extracted from {images_table} (photos read under "
            f"{image_root}): {report.skipped_summary()}"
        )
    return report
