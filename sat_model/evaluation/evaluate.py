"""Evaluate a trained model on one split: decode, score, ground, and draw attention.

Dimensions: ``B`` images per batch, ``L`` locations, ``D`` annotation size.

1. Batched beam search over the split's features, one caption per image.
2. Scores against all of that image's references with pycocoevalcap's own scorers
   (:func:`sat_model.evaluation.metrics.score_captions`: PTB tokeniser, BLEU-1..4, METEOR, ROUGE-L,
   CIDEr-D).
3. Where the source has boxes (synthetic scenes): pointing accuracy of α on the objects the
   generated words name (:mod:`sat_model.evaluation.grounding`).
4. Attention pictures (Sec. 5.4) for the first ``gallery_images`` images (by id), each listed
   with its reference captions and its own scores (``metrics.score_images``).

Images are evaluated when they have both features and references; every other image of the split
is reported in ``skipped`` with its reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from sat_model.atomic import write_text_atomic
from sat_model.config import EncoderConfig, EvalConfig
from sat_model.data.tables import ImageRecord, load_references, read_images
from sat_model.data.vocab import Vocab
from sat_model.evaluation.grounding import (
    GroundingSample,
    PointingResult,
    ground_tokens,
    pointing_accuracy,
)
from sat_model.evaluation.metrics import score_captions, score_images
from sat_model.evaluation.reports import CAPTIONS_FILE, METRICS_FILE
from sat_model.evaluation.visualize import INDEX_FILE, Attended, AttentionFigures
from sat_model.features.images import ImageError, Preprocessing, to_picture
from sat_model.features.store import FeatureStore
from sat_model.model.checkpoint import load_model
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import Decoding, beam_search, decode_mode, length_penalty_for

__all__ = [
    "DataSplit",
    "DecodedCaption",
    "EvaluationError",
    "EvaluationResult",
    "FeatureView",
    "decode_split",
    "evaluate_model",
    "read_image_records",
    "write_attention_gallery",
    "write_reports",
]


class EvaluationError(RuntimeError):
    """Nothing usable to evaluate (no image with both features and references)."""


@dataclass(frozen=True)
class DecodedCaption:
    image_id: str
    words: tuple[str, ...]
    alphas: np.ndarray  # (len(words), L)
    score: float
    locations: np.ndarray | None = None  # (len(words),) the cells s̃_t a sampling decoder drew

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class EvaluationResult:
    metrics: dict[str, float]
    captions: list[DecodedCaption]
    skipped: list[dict[str, str]] = field(default_factory=list)
    grounding: PointingResult | None = None
    references: dict[str, list[str]] = field(default_factory=dict)  # image id -> raw captions
    image_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # id -> key -> score


def read_image_records(
    images_path: str | Path, split: str, image_root: str | Path | None = None
) -> dict[str, ImageRecord]:
    """The usable images of ``split`` keyed by id (:func:`sat_model.data.tables.read_images`).

    Photos are opened only under ``image_root``, from params; without it every record is refused
    for opening (sizes and boxes, all grounding needs, are still read).
    """
    return {r.image_id: r for r in read_images(images_path, image_root, split)}


def _decode_batch(
    model: ShowAttendTell,
    vocab: Vocab,
    annotations: torch.Tensor,
    ids: Sequence[str],
    **search: Any,
) -> list[DecodedCaption]:
    out = []
    for image_id, c in zip(ids, beam_search(model, annotations, **search), strict=True):
        words, alphas = c.words(vocab)
        out.append(DecodedCaption(image_id, words, alphas, float(c.score), c.word_locations(vocab)))
    return out


@dataclass(frozen=True)
class DataSplit:
    """The split evaluated and the prepared files it is read from."""

    name: str  # "test", "val"...
    features_path: Path  # its feature store
    captions_path: Path  # captions.parquet (the references)
    images_path: Path  # images.parquet (sizes and boxes, for grounding)


@dataclass(frozen=True)
class FeatureView:
    """What the encoder saw of each photo (the feature grid over the crop of the resized photo):
    what grounding and the attention figures map the attention weights back onto."""

    grid_h: int
    grid_w: int
    resize: int  # the shorter side (or both sides without keep_aspect), in pixels
    crop: int  # the encoder's centre crop, in pixels
    keep_aspect: bool = True


def decode_split(
    model: ShowAttendTell,
    vocab: Vocab,
    store: FeatureStore,
    image_ids: Sequence[str],
    decoding: Decoding,
    device: str | torch.device = "cpu",
) -> list[DecodedCaption]:
    """One beam-search caption per image id, decoded ``decoding.batch_size`` images at a time."""
    search = dict(
        beam_size=decoding.beam_size,
        max_length=decoding.max_length,
        length_penalty=decoding.length_penalty,
        mode=decoding.mode,
    )
    out: list[DecodedCaption] = []
    for start in range(0, len(image_ids), decoding.batch_size):
        ids = image_ids[start : start + decoding.batch_size]
        rows = [store.index_of(i) for i in ids]
        feats = torch.from_numpy(store.get_batch(rows)).to(device, torch.float32)  # (B, L, D)
        out += _decode_batch(model, vocab, feats, ids, **search)
    return out


def _select_images(
    store_ids: Sequence[str], references: Mapping[str, Sequence[str]]
) -> tuple[list[str], list[dict[str, str]]]:
    in_store = set(store_ids)
    ids = sorted(i for i in references if i in in_store)
    skipped = [{"item": i, "reason": "no features"} for i in sorted(set(references) - in_store)]
    skipped += [
        {"item": i, "reason": "no reference caption"} for i in sorted(in_store - set(references))
    ]
    return ids, skipped


def _grounding(
    captions: Sequence[DecodedCaption], records: Mapping[str, ImageRecord], view: FeatureView
) -> PointingResult | None:
    samples = []
    for c in captions:
        record = records.get(c.image_id)
        if record is None or not record.boxes or record.width is None or record.height is None:
            continue
        targets = ground_tokens(c.words, record.boxes)
        samples.append(
            GroundingSample(c.alphas, record.boxes, targets, record.width, record.height)
        )
    if not samples:  # the source has no boxes: grounding is not measured
        return None
    return pointing_accuracy(
        samples,
        grid_h=view.grid_h,
        grid_w=view.grid_w,
        resize=view.resize,
        crop=view.crop,
        keep_aspect=view.keep_aspect,
    )


def evaluate_model(
    model_dir: str | Path,
    split: DataSplit,
    settings: EvalConfig,
    encoder: EncoderConfig,
    *,
    metrics: Sequence[str] | None = None,  # None: every registered metric
    device: str | torch.device = "cpu",
) -> EvaluationResult:
    """Decode ``split`` with the model in ``model_dir`` as ``settings`` (``params.eval``) say,
    score it, and measure grounding on the photos as ``encoder`` (``params.encoder``) cut them.

    ``settings.length_penalty`` and ``settings.hard_decode`` apply as the model's attention
    variant asks: the penalty is given per variant, ``hard_decode`` is hard attention's alone.
    """
    model, vocab, config = load_model(model_dir, device=device)
    store = FeatureStore(split.features_path)
    references = load_references(split.captions_path, split.name)
    ids, skipped = _select_images(store.ids, references)
    if not ids:
        raise EvaluationError(
            f"no {split.name!r} image has both features ({split.features_path}) and references "
            f"({split.captions_path}); {len(skipped)} skipped"
        )
    decoding = Decoding(
        settings.beam_size,
        settings.max_length,
        length_penalty_for(settings.length_penalty.model_dump(), config.attention),
        decode_mode(settings.hard_decode, config.attention),
        settings.batch_size,
    )
    captions = decode_split(model, vocab, store, ids, decoding, device)
    hypotheses = {c.image_id: c.text for c in captions}
    scored = {i: list(references[i]) for i in ids}
    scores = score_captions(hypotheses, scored, metrics, meteor_timeout_s=settings.meteor_timeout_s)
    spec = store.spec
    view = FeatureView(
        spec.grid_h, spec.grid_w, encoder.resize, spec.input_size, encoder.keep_aspect
    )
    grounding = _grounding(captions, read_image_records(split.images_path, split.name), view)
    if grounding is not None and grounding.total:  # NaN is not JSON: unmeasured is left out
        scores["pointing_accuracy"] = grounding.accuracy
    return EvaluationResult(
        scores, captions, skipped, grounding, scored, score_images(hypotheses, scored)
    )


def write_reports(result: EvaluationResult, out_dir: str | Path, split: str) -> None:
    """``metrics.json`` (the scores alone, flat keys, for ``dvc metrics``) and ``captions.json``
    (the captions and the counts: images captioned, words whose pointing was checked)."""
    out_dir = Path(out_dir)
    metrics = {k: round(v, 6) for k, v in result.metrics.items() if math.isfinite(v)}
    write_text_atomic(out_dir / METRICS_FILE, json.dumps(metrics, indent=2) + "\n")
    counts = {"images": len(result.captions)}
    if result.grounding is not None:
        counts["pointing_words"] = result.grounding.total
    captions = {
        "split": split,
        **counts,
        "captions": [
            {"image_id": c.image_id, "caption": c.text, "log_prob": round(c.score, 4)}
            for c in result.captions
        ],
        "skipped": result.skipped,
    }
    write_text_atomic(out_dir / CAPTIONS_FILE, json.dumps(captions, indent=1) + "\n")


def write_attention_gallery(
    captions: Sequence[DecodedCaption],
    records: Mapping[str, ImageRecord],
    out_dir: str | Path,
    *,
    count: int,
    view: FeatureView,
    title: str,
    mode: str = "expected",
    scored: EvaluationResult | None = None,
) -> tuple[Path, list[dict[str, str]]]:
    """The attention figures of the first ``count`` captions (by image id), ``images/000.png``,
    ``001.png``... in that order, and ``index.html``; ``mode`` is how they were decoded. With
    ``scored`` (the evaluation), the page lists each image's references and its own scores.

    Returns the gallery page and the images skipped (unreadable photo, no image record).
    """
    skipped: list[dict[str, str]] = []
    references = scored.references if scored else {}
    image_scores = scored.image_scores if scored else {}
    with AttentionFigures(out_dir, title, mode=mode) as figures:
        for c in sorted(captions, key=lambda c: c.image_id)[:count]:
            photo = _gallery_photo(records.get(c.image_id), view)
            if isinstance(photo, str):
                skipped.append({"item": c.image_id, "reason": photo})
                continue
            figures.add(
                c.image_id,
                f"{len(figures):03d}",  # 000, 001...: names a dvc.yaml plot can list
                photo,
                Attended(c.words, c.alphas, view.grid_h, view.grid_w, c.locations),
                references=references.get(c.image_id, ()),
                scores=image_scores.get(c.image_id),
            )
    return Path(out_dir) / INDEX_FILE, skipped


def _gallery_photo(record: ImageRecord | None, view: FeatureView) -> Image.Image | str:
    """The crop the encoder saw of ``record``'s photo, or why there is none."""
    if record is None:
        return "not in the image table"
    if record.refused:
        return record.refused
    try:
        pixels = Preprocessing(view.resize, view.crop, keep_aspect=view.keep_aspect).pixels(
            record.path
        )
        return to_picture(pixels)  # as the extract stage cut it
    except ImageError as e:
        return e.reason
