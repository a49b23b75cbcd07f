"""Validation during training: free-running greedy captions of the first val images, scored by
the evaluation's own scorer, once per epoch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sat_model.data.vocab import Vocab
from sat_model.evaluation.metrics import score_captions
from sat_model.features.store import FeatureStore
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import greedy

__all__ = ["VALIDATION_METRICS", "make_validator"]

# BLEU drives early stopping; CIDEr is logged beside it (no Java, milliseconds on val_images)
VALIDATION_METRICS = ("bleu", "cider")


def make_validator(
    store: FeatureStore,
    references: dict[str, list[str]],
    vocab: Vocab,
    *,
    max_images: int,
    max_length: int,
    batch_size: int,
    device: torch.device | str,
    mode: str = "expected",
) -> Callable[[nn.Module], dict[str, float]]:
    """``validate(model)``: BLEU and CIDEr of free-running greedy captions on the first val
    images, by ``metrics.score_captions(..., metrics=VALIDATION_METRICS)``, the evaluation's own
    scorer (CIDEr's idf comes from these images' references only, so it is comparable across
    epochs of one run, not with the test-set figure).
    """
    ids = [i for i in store.ids if i in references]
    ids = ids[:max_images] if max_images > 0 else ids
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
        return score_captions(hypotheses, refs, metrics=VALIDATION_METRICS)

    return validate
