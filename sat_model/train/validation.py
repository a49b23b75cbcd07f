"""Validation during training: free-running greedy captions of the first val images, scored by
the evaluation's own scorer, once per epoch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sat_model.data.vocab import Vocab
from sat_model.evaluation.metrics import metric_of_key, score_captions
from sat_model.features.store import FeatureStore
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import greedy

__all__ = ["VALIDATION_METRICS", "ValidationOptions", "make_validator", "validation_metrics"]

# BLEU and CIDEr are scored every epoch (no Java, milliseconds on val_images)
VALIDATION_METRICS = ("bleu", "cider")


def validation_metrics(monitor: str) -> tuple[str, ...]:
    """The metric families validation scores: BLEU, CIDEr and the one ``train.monitor`` names."""
    family = metric_of_key(monitor)
    return VALIDATION_METRICS if family in VALIDATION_METRICS else (*VALIDATION_METRICS, family)


@dataclass(frozen=True)
class ValidationOptions:
    """How validation decodes and scores (``train.val_images``, ``train.val_max_length``, ...)."""

    max_images: int  # the first val images scored (0: all)
    max_length: int  # the longest caption decoded
    batch_size: int  # images decoded together
    mode: str = "expected"  # hard attention's decoding (sat_model.model.decoding.decode_mode)
    metrics: tuple[str, ...] = VALIDATION_METRICS  # families scored (validation_metrics)


def make_validator(
    store: FeatureStore,
    references: dict[str, list[str]],
    vocab: Vocab,
    device: torch.device | str,
    options: ValidationOptions,
) -> Callable[[nn.Module], dict[str, float]]:
    """``validate(model)``: BLEU, CIDEr and the monitored metric of free-running greedy captions
    on the first val images, by ``metrics.score_captions``, the evaluation's own scorer
    (CIDEr's idf comes from these images' references only, so it is comparable across epochs of
    one run, not with the test-set figure).
    """
    max_length, batch_size, mode = options.max_length, options.batch_size, options.mode
    ids = [i for i in store.ids if i in references]
    ids = ids[: options.max_images] if options.max_images > 0 else ids
    if not ids:
        raise ValueError("no validation image has both features and reference captions")
    rows = [store.index_of(i) for i in ids]
    refs = {i: references[i] for i in ids}

    def validate(model: nn.Module) -> dict[str, float]:
        assert isinstance(model, ShowAttendTell)  # fit validates the model it was given
        hypotheses: dict[str, str] = {}
        for start in range(0, len(rows), batch_size):
            feats = store.get_batch(rows[start : start + batch_size])  # (B, L, D) float16
            annotations = torch.from_numpy(feats).to(device, torch.float32)  # (B, L, D)
            captions = greedy(model, annotations, max_length, mode=mode)
            for image_id, caption in zip(ids[start : start + batch_size], captions, strict=True):
                hypotheses[image_id] = " ".join(vocab.decode(caption.tokens))
        return score_captions(hypotheses, refs, metrics=options.metrics)

    return validate
