"""Self-critical sequence training (SCST): fine-tuning on the evaluation metric, beyond the paper.

Rennie et al. (2017) fine-tune a likelihood-trained captioner with REINFORCE on the CIDEr-D of
captions it draws itself; the baseline here is the mean reward of the image's other drawn
captions (Luo, 2020), so no greedy decode is needed:

    ∇L = -Σ_i (r_i - mean_{j≠i} r_j) ∇ log p(w^i | a),   w^i ~ p(· | a), i = 1..n per image.

The reward is CIDEr-D with document frequencies fixed from the training corpus (pycocoevalcap
recomputes them on every call, hence :class:`CiderD`), plus, optionally, the caption's own
BLEU-4 and BLEU-1. docs/METHOD.md ("Self-critical fine-tuning") gives every detail and why.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from sat_model.data.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import sample
from sat_model.model.losses import LossOutput
from sat_model.train.batching import CaptionDataset, split_to_multiple

__all__ = [
    "CiderD",
    "ImageBatches",
    "Reward",
    "SampledBatch",
    "SamplingPlan",
    "leave_one_out_advantages",
    "references_by_image",
    "self_critical_step",
    "sentence_bleu",
]

_NO_MATCH = -1  # what a drawn <unk> becomes: an id that no reference holds
_Vector = tuple[list[dict[tuple[int, ...], float]], list[float], int]  # per-n tf-idf, norms, length


def _ngrams(tokens: Sequence[int], n: int) -> Counter[tuple[int, ...]]:
    return Counter(
        tuple(tokens[i : i + k]) for k in range(1, n + 1) for i in range(len(tokens) - k + 1)
    )


class CiderD:
    """CIDEr-D of token-id captions against each image's references, with the document
    frequencies of ``references`` (all training images), fixed at construction."""

    def __init__(
        self, references: Mapping[int, Sequence[Sequence[int]]], n: int = 4, sigma: float = 6.0
    ) -> None:
        if not references:
            raise ValueError("CIDEr-D needs at least one image's references")
        self.n, self.sigma = n, sigma
        self.references = references
        df: Counter[tuple[int, ...]] = Counter()
        for refs in references.values():
            df.update({g for ref in refs for g in _ngrams(ref, n)})  # one count per image
        self._log_df = {g: math.log(c) for g, c in df.items()}
        self._log_docs = math.log(len(references))
        self._ref_vectors: dict[int, list[_Vector]] = {}

    def _vector(self, tokens: Sequence[int]) -> _Vector:
        """tf-idf per n-gram order, the orders' norms and the caption's length (pycocoevalcap's
        ``counts2vec``: its length counts the 2-grams)."""
        vec: list[dict[tuple[int, ...], float]] = [{} for _ in range(self.n)]
        norm = [0.0] * self.n
        for gram, tf in _ngrams(tokens, self.n).items():
            k = len(gram) - 1
            value = tf * (self._log_docs - self._log_df.get(gram, 0.0))
            vec[k][gram] = value
            norm[k] += value * value
        return vec, [math.sqrt(x) for x in norm], max(len(tokens) - 1, 0)

    def _similarity(self, hyp: _Vector, ref: _Vector) -> float:
        (vh, nh, lh), (vr, nr, lr) = hyp, ref
        penalty = math.exp(-((lh - lr) ** 2) / (2 * self.sigma**2))
        total = 0.0
        for k in range(self.n):
            dot = sum(min(v, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, v in vh[k].items())
            if nh[k] != 0 and nr[k] != 0:
                total += dot / (nh[k] * nr[k]) * penalty
        return total / self.n

    def score(self, image: int, tokens: Sequence[int]) -> float:
        """CIDEr-D of one caption (ids, ``<end>`` included when it ended) for ``image``."""
        refs = self._ref_vectors.get(image)
        if refs is None:
            refs = self._ref_vectors[image] = [self._vector(r) for r in self.references[image]]
        hyp = self._vector(tokens)
        return 10.0 * sum(self._similarity(hyp, r) for r in refs) / len(refs)


def sentence_bleu(
    references: Sequence[Sequence[Sequence[int]]], captions: Sequence[Sequence[int]]
) -> list[tuple[float, float, float, float]]:
    """pycocoevalcap's BLEU-1..4 of each caption (ids) against its own references (ids), the
    words only: ``<end>`` is not a word of the evaluated captions."""
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer

    def words(tokens: Sequence[int]) -> str:
        return " ".join(str(t) for t in tokens if t != END_ID)

    scorer = BleuScorer(n=4)
    for refs, caption in zip(references, captions, strict=True):
        scorer += (words(caption), [words(r) for r in refs])
    _, per_order = scorer.compute_score(option="closest")
    b1, b2, b3, b4 = per_order  # each order's score of every caption
    return [
        (float(a), float(b), float(c), float(d)) for a, b, c, d in zip(b1, b2, b3, b4, strict=True)
    ]


class Reward:
    """The reward of drawn captions: CIDEr-D (:class:`CiderD`), plus ``bleu_weight`` times
    their BLEU-4 and ``bleu1_weight`` times their BLEU-1 (:func:`sentence_bleu`)."""

    def __init__(
        self,
        references: Mapping[int, Sequence[Sequence[int]]],
        bleu_weight: float = 0.0,
        bleu1_weight: float = 0.0,
    ) -> None:
        for name, weight in (("bleu_weight", bleu_weight), ("bleu1_weight", bleu1_weight)):
            if weight < 0:
                raise ValueError(f"{name} must be >= 0, got {weight}")
        self.cider = CiderD(references)
        self.bleu_weight = bleu_weight
        self.bleu1_weight = bleu1_weight

    @property
    def references(self) -> Mapping[int, Sequence[Sequence[int]]]:
        """Each training image's references (ids), the ones CIDEr-D holds."""
        return self.cider.references

    def __call__(self, images: Sequence[int], captions: Sequence[Sequence[int]]) -> Tensor:
        """The rewards of ``captions`` (token ids as drawn, ``<start>`` and padding allowed),
        ``images[i]`` being the store row of caption i: (len(captions),) float32. A drawn
        ``<unk>`` matches no reference word (the module's docstring says why)."""
        scored = [tuple(_NO_MATCH if t == UNK_ID else t for t in _scored(c)) for c in captions]
        rewards = [self.cider.score(i, c) for i, c in zip(images, scored, strict=True)]
        if self.bleu_weight > 0 or self.bleu1_weight > 0:
            bleu = sentence_bleu([self.references[i] for i in images], scored)
            rewards = [
                r + self.bleu1_weight * b[0] + self.bleu_weight * b[3]
                for r, b in zip(rewards, bleu, strict=True)
            ]
        return torch.tensor(rewards, dtype=torch.float32)


def references_by_image(dataset: CaptionDataset) -> dict[int, list[tuple[int, ...]]]:
    """Each store row's reference captions as scored ids: ``<start>`` dropped, ``<end>`` kept."""
    refs: dict[int, list[tuple[int, ...]]] = {}
    for row, caption in zip(dataset.image_indices.tolist(), dataset.captions, strict=True):
        refs.setdefault(row, []).append(_scored(caption))
    return refs


def _scored(caption: Sequence[int]) -> tuple[int, ...]:
    """A caption as CIDEr-D sees it: the words and ``<end>``, no ``<start>`` or padding."""
    out = []
    for t in caption:
        if t == START_ID:
            continue
        if t == PAD_ID:
            break
        out.append(int(t))
        if t == END_ID:
            break
    return tuple(out)


def leave_one_out_advantages(rewards: Tensor, num_samples: int) -> Tensor:
    """r_i - mean_{j≠i} r_j within each image's ``num_samples`` consecutive rows: (B*n,)."""
    if num_samples < 2:
        raise ValueError(f"the leave-one-out baseline needs >= 2 samples, got {num_samples}")
    per_image = rewards.view(-1, num_samples)  # (B, n)
    others = (per_image.sum(1, keepdim=True) - per_image) / (num_samples - 1)
    return (per_image - others).view(-1)


@dataclass(frozen=True)
class SampledBatch:
    """Captions a model drew for a batch of images, with their advantages (training layout)."""

    annotations: Tensor  # (B, L, D) float32, once per image
    captions: Tensor  # (B*n, T+1) long: <start> w_1 .. w_k <end> <pad>.., image i's n in a row
    advantages: Tensor  # (B*n,) float32, r_i - mean_{j≠i} r_j (r: the Reward)
    num_samples: int = 1  # n

    def to(self, device: torch.device | str) -> SampledBatch:
        return SampledBatch(
            self.annotations.to(device, non_blocking=True),
            self.captions.to(device, non_blocking=True),
            self.advantages.to(device, non_blocking=True),
            self.num_samples,
        )


@dataclass(frozen=True)
class SamplingPlan:
    """How self-critical epochs draw: images per batch (``scst_batch_size``), captions drawn
    per image (``scst_samples``), their longest length, and the seed of the batch order."""

    batch_size: int
    num_samples: int
    max_length: int
    seed: int


class ImageBatches:
    """One epoch of self-critical batches: every training image once, ``batch_size`` images a
    batch in an order drawn from ``(seed, epoch)``, this rank's every ``num_replicas``-th batch
    (halved as the caption sampler halves, so ranks step equally); each batch's captions are
    drawn from ``model`` as it is when the batch is reached."""

    def __init__(
        self,
        dataset: CaptionDataset,
        model: ShowAttendTell,
        reward: Reward,
        plan: SamplingPlan,
        *,
        epoch: int,
        rank: int = 0,
        num_replicas: int = 1,
    ) -> None:
        self.dataset, self.model, self.reward = dataset, model, reward
        self.num_samples, self.max_length = plan.num_samples, plan.max_length
        batch_size = plan.batch_size
        images = np.array(sorted(reward.references), dtype=np.int64)
        order = np.random.default_rng([plan.seed, epoch, 2]).permutation(images)
        batches = [order[i : i + batch_size].tolist() for i in range(0, order.size, batch_size)]
        self.batches = split_to_multiple(batches, num_replicas)[rank::num_replicas]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[SampledBatch]:
        device = next(self.model.parameters()).device
        for rows in self.batches:
            feats = self.dataset.store.get_batch(rows)  # (B, L, D) float16
            annotations = torch.from_numpy(feats).to(device, torch.float32)  # (B, L, D)
            # the path self_critical_step back-propagates through: α's expected context
            captions = sample(self.model, annotations, self.num_samples, self.max_length)
            images = np.repeat(rows, self.num_samples).tolist()  # (B*n,)
            rewards = self.reward(images, captions.cpu().tolist())  # (B*n,)
            yield SampledBatch(
                annotations=annotations,
                captions=captions,
                advantages=leave_one_out_advantages(rewards, self.num_samples).to(device),
                num_samples=self.num_samples,
            )


def self_critical_step(model: nn.Module, criterion: nn.Module, batch: SampledBatch) -> LossOutput:
    """The teacher-forced pass over the drawn captions, without dropout (the sampling policy),
    and the loss; ``fit``'s ``step_loss`` for self-critical epochs. Each image's annotations
    are prepared once for its n captions (``rows_per_image``), not n times."""
    model.eval()
    try:
        output = model(
            batch.annotations, batch.captions, mode="expected", rows_per_image=batch.num_samples
        )
    finally:
        model.train()
    out: LossOutput = criterion(output, batch.captions, batch.advantages)
    return out
