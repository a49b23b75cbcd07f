"""Free-running decoding: greedy and batched beam search over log-probabilities.

Dimensions (docs/METHOD.md): ``B`` images, ``k`` beams, ``L`` annotation locations, ``K`` vocabulary
size, ``t`` steps decoded so far.

``max_length`` bounds the number of decoding steps, ``<end>`` included: a caption that reaches
``<end>`` has at most ``max_length - 1`` words; one that never does has exactly ``max_length``
words and ``finished=False``. Scores are summed log-probabilities (log_softmax, never raw
logits) of every emitted token, ``<end>`` included when it was reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sat_model.data.vocab import END_ID, PAD_ID, START_ID, Vocab
from sat_model.model.decoder import MODES, ShowAttendTell
from sat_model.model.outputs import DecoderState

__all__ = [
    "Caption",
    "Decoding",
    "beam_search",
    "decode_mode",
    "greedy",
    "length_penalty_for",
    "sample",
]


@dataclass(frozen=True)
class Caption:
    tokens: list[int]  # word ids, without <start>/<end>
    score: float  # summed log-probabilities, <end> included when reached
    alphas: np.ndarray  # (len(tokens), L): the attention while each word was emitted
    finished: bool = True  # False when max_length ran out before <end>
    # (len(tokens),) the cell s̃_t hard attention read for each word; None where it read Σ α a
    locations: np.ndarray | None = None

    def words(self, vocab: Vocab) -> tuple[tuple[str, ...], np.ndarray]:
        """The words (:meth:`Vocab.decode_positions`) and each word's α row, (len(words), L)."""
        words, positions = vocab.decode_positions(self.tokens)
        return tuple(words), np.asarray(self.alphas, dtype=np.float32)[positions]

    def word_locations(self, vocab: Vocab) -> np.ndarray | None:
        """The cell read for each of :meth:`words` (len(words),), or None."""
        if self.locations is None:
            return None
        return np.asarray(self.locations)[vocab.decode_positions(self.tokens)[1]]


def _check_args(annotations: Tensor, max_length: int, mode: str, beam_size: int = 1) -> None:
    if annotations.dim() != 3:
        raise ValueError(f"annotations must be (B, L, D), got shape {tuple(annotations.shape)}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if mode == "train" or mode not in MODES:
        raise ValueError(f"decoding mode must be 'expected', 'sample' or 'argmax', got {mode!r}")


def greedy(
    model: ShowAttendTell,
    annotations: Tensor,
    max_length: int,
    mode: str = "expected",
) -> list[Caption]:
    """The most probable word at every step, for each of the B images at once."""
    _check_args(annotations, max_length, mode)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return _greedy(model, annotations, max_length, mode)
    finally:
        model.train(was_training)


def _greedy(
    model: ShowAttendTell, annotations: Tensor, max_length: int, mode: str
) -> list[Caption]:
    B = annotations.size(0)
    state = model.init_state(annotations)
    prev = torch.full((B,), START_ID, dtype=torch.long, device=annotations.device)
    finished = torch.zeros(B, dtype=torch.bool, device=annotations.device)
    score = torch.zeros(B, device=annotations.device)
    tokens, alphas = [], []
    for _ in range(max_length):
        out = model.step(prev, state, mode)
        log_prob, prev = torch.log_softmax(out.logits.float(), dim=-1).max(dim=-1)  # (B,), (B,)
        score = score + torch.where(finished, 0.0, log_prob)
        finished = finished | (prev == END_ID)
        tokens.append(prev)
        alphas.append(out.alpha)
        state = out.state
        # one sync per step buys stopping as soon as every caption has ended
        if bool(finished.all()):
            break
    return _captions(
        torch.stack(tokens, 1).cpu().numpy(),  # (B, t)
        torch.stack(alphas, 1).float().cpu().numpy(),  # (B, t, L)
        score.cpu().numpy(),
    )


def sample(
    model: ShowAttendTell,
    annotations: Tensor,
    num_samples: int,
    max_length: int,
    mode: str = "expected",
) -> Tensor:
    """``num_samples`` captions per image, each word drawn from p(y_t | a, y_<t) (softmax,
    temperature 1, ``<pad>`` and ``<start>`` left out), for self-critical training:
    (B * num_samples, t + 1) long in the training layout, ``<start> w_1 .. w_k <end> <pad>..``,
    image ``i``'s samples in rows ``i * num_samples ..``; a caption that never drew ``<end>``
    has ``max_length`` words.

    Runs in eval mode (no dropout) under ``no_grad``: the rows can feed a teacher-forced pass
    that back-propagates (inference tensors could not).
    """
    _check_args(annotations, max_length, mode)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _sample(model, annotations, num_samples, max_length, mode)
    finally:
        model.train(was_training)


def _sample(
    model: ShowAttendTell, annotations: Tensor, n: int, max_length: int, mode: str
) -> Tensor:
    B, device = annotations.size(0), annotations.device
    # the annotations and W_a a stay once per image, shared by its n rows of h, c (as beams)
    rows = torch.arange(B, device=device).repeat_interleave(n)  # (B*n,)
    state = model.init_state(annotations).reorder(rows)
    prev = torch.full((B * n,), START_ID, dtype=torch.long, device=device)
    finished = torch.zeros(B * n, dtype=torch.bool, device=device)
    tokens = [prev]
    never_drawn = torch.tensor([PAD_ID, START_ID], device=device)
    for _ in range(max_length):
        out = model.step(prev, state, mode)
        # <pad> and <start> are never targets; a drawn <pad> would read as the caption's end
        logits = out.logits.float().index_fill(1, never_drawn, float("-inf"))  # (B*n, K)
        probs = torch.softmax(logits, dim=-1)
        drawn = torch.multinomial(probs, 1).squeeze(1)  # (B*n,)
        prev = torch.where(finished, PAD_ID, drawn)  # after <end>: padding
        tokens.append(prev)
        finished = finished | (drawn == END_ID)
        state = out.state
        # one sync per step buys stopping as soon as every caption has ended
        if bool(finished.all()):
            break
    return torch.stack(tokens, dim=1)  # (B*n, t+1)


def _captions(
    tokens: np.ndarray,
    alphas: np.ndarray,
    scores: np.ndarray,
    locations: np.ndarray | None = None,
) -> list[Caption]:
    """Cut each row at its first <end>: tokens (N, t), alphas (N, t, L), scores (N,),
    locations (N, t) or None."""
    captions: list[Caption] = []
    for i, (row, scores_row) in enumerate(zip(tokens, scores, strict=True)):
        ends = np.flatnonzero(row == END_ID)
        n = int(ends[0]) if ends.size else int(row.size)
        captions.append(
            Caption(
                tokens=row[:n].tolist(),
                score=float(scores_row),
                alphas=alphas[i, :n],
                finished=bool(ends.size),
                locations=None if locations is None else locations[i, :n],
            )
        )
    return captions


def length_penalty_for(length_penalty: float | Mapping[str, float], attention: str) -> float:
    """The α that ranks ``attention``'s beams: ``length_penalty`` itself, or its entry for
    ``attention`` when it is given per variant (``{"soft": 1.0, "hard": 2.0}``)."""
    if isinstance(length_penalty, Mapping):
        return float(length_penalty[attention])
    return float(length_penalty)


def decode_mode(hard_decode: str, attention: str) -> str:
    """How a model of ``attention`` reads its annotations when decoding: ``hard_decode``
    (``eval.hard_decode``: expected, sample or argmax) for the hard model, and always the
    expected context (Eq. 6) for the soft one, which was trained on it."""
    return hard_decode if attention == "hard" else "expected"


def beam_search(
    model: ShowAttendTell,
    annotations: Tensor,
    beam_size: int,
    max_length: int,
    length_penalty: float = 0.0,
    mode: str = "expected",
) -> list[Caption]:
    """Beam search with all B images × k beams advancing as one batch of B*k rows.

    Finished beams stay in the beam, extended by ``<end>`` at no cost, so they compete with the
    unfinished ones on equal terms. The result per image is the best finished hypothesis, ranked
    by its summed log-probability divided by length^``length_penalty`` (0: the sum, which
    favours short captions; 1: per token; above 1: longer captions), or the best unfinished one
    when none finished. With ``beam_size=1`` this is greedy decoding.
    """
    _check_args(annotations, max_length, mode, beam_size)
    if not length_penalty >= 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return _beam_search(model, annotations, beam_size, max_length, length_penalty, mode)
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class _Beams:
    """The live beams after some steps; the history is kept as back-pointers (``_Step``), so a
    step costs the same whatever its index (no re-copying of every past token and α)."""

    scores: Tensor  # (B, w) summed log-probabilities; w = 1 before the first step, then k
    finished: Tensor  # (B*w,) bool, <end> emitted
    length: Tensor  # (B*w,) long, tokens emitted up to and including the first <end>
    state: DecoderState


@dataclass(frozen=True)
class _Step:
    token: Tensor  # (B*k,) the token each beam emitted at this step
    parent: Tensor  # (B*k,) the row (of the previous step's beams) it extends
    alpha: Tensor  # (B*w, L) α of the previous step's rows: row parent[j] is beam j's
    location: Tensor | None = None  # (B*w,) the cell those rows read (hard attention), or None


def _beam_search(
    model: ShowAttendTell,
    annotations: Tensor,
    k: int,
    max_length: int,
    length_penalty: float,
    mode: str,
) -> list[Caption]:
    B = annotations.size(0)
    device = annotations.device
    # one row per image until the first step has produced k different words: k copies of
    # h_0 would only make k identical hypotheses. The first step's top k then spread each image
    # to k rows of h, c (B*k, n); the annotations and W_a a stay once per image, shared by them
    beams = _Beams(
        scores=torch.zeros(B, 1, device=device),
        finished=torch.zeros(B, dtype=torch.bool, device=device),
        length=torch.zeros(B, dtype=torch.long, device=device),
        state=model.init_state(annotations),
    )
    prev = torch.full((B,), START_ID, dtype=torch.long, device=device)
    history: list[_Step] = []
    for _ in range(max_length):
        beams, step = _advance(model, beams, prev, k, mode)
        history.append(step)
        prev = step.token
        # one sync per step buys stopping as soon as every beam has ended
        if bool(beams.finished.all()):
            break
    return _best_captions(beams, history, length_penalty)


def _advance(
    model: ShowAttendTell, beams: _Beams, prev: Tensor, k: int, mode: str
) -> tuple[_Beams, _Step]:
    """One step for all B*w rows (w = 1 at the first step, then k): extend, keep the k best of
    the w*K continuations per image, reorder."""
    out = model.step(prev, beams.state, mode)
    log_probs = torch.log_softmax(out.logits.float(), dim=-1)  # (B*w, K)
    K = log_probs.size(1)
    # a finished beam may only continue with <end>, at log-probability 0
    ended = torch.full_like(log_probs[:1], float("-inf"))
    ended[0, END_ID] = 0.0
    log_probs = torch.where(beams.finished.unsqueeze(1), ended, log_probs)
    B, w = beams.scores.shape
    candidates = (beams.scores.view(B * w, 1) + log_probs).view(B, w * K)  # (B, w*K)
    # fewer than k continuations only when the vocabulary is smaller than the beam
    scores, flat = candidates.topk(min(k, w * K), dim=1)  # (B, k)
    parent = torch.div(flat, K, rounding_mode="floor")  # (B, k), beam index within the image
    token = flat.remainder(K).view(-1)  # (B*k,)
    rows = (torch.arange(B, device=flat.device).unsqueeze(1) * w + parent).view(-1)  # (B*k,)
    was_finished = beams.finished[rows]
    beams = _Beams(
        scores=scores,
        finished=was_finished | (token == END_ID),
        length=beams.length[rows] + (~was_finished).long(),
        state=out.state.reorder(rows),
    )
    return beams, _Step(token=token, parent=rows, alpha=out.alpha, location=out.location)


def _best_captions(beams: _Beams, history: list[_Step], length_penalty: float) -> list[Caption]:
    """The best hypothesis of each image, read back along its back-pointers, as a Caption."""
    B, k = beams.scores.shape  # k < beam_size only when the vocabulary is smaller than it
    finished = beams.finished.view(B, k)
    length = beams.length.view(B, k).to(beams.scores.dtype)
    rank = beams.scores / length.clamp(min=1) ** length_penalty if length_penalty else beams.scores
    # prefer finished hypotheses; fall back to unfinished ones only where none finished
    eligible = finished | ~finished.any(1, keepdim=True)
    best = torch.where(eligible, rank, float("-inf")).argmax(1)  # (B,)
    row = torch.arange(B, device=best.device) * k + best  # (B,) rows of the last step
    score = beams.scores.gather(1, best.unsqueeze(1)).squeeze(1)  # (B,)
    tokens, alphas, locations = [], [], []
    for step in reversed(history):
        tokens.append(step.token[row])
        row = step.parent[row]
        alphas.append(step.alpha[row])
        if step.location is not None:
            locations.append(step.location[row])
    return _captions(
        torch.stack(tokens[::-1], 1).cpu().numpy(),  # (B, t)
        torch.stack(alphas[::-1], 1).float().cpu().numpy(),  # (B, t, L)
        score.float().cpu().numpy(),
        torch.stack(locations[::-1], 1).cpu().numpy() if locations else None,  # (B, t)
    )


@dataclass(frozen=True)
class Decoding:
    """How a split is decoded: beam search's width, its longest caption, the length penalty α,
    hard attention's mode (:func:`sat_model.model.decoding.decode_mode`), images per batch (the
    defaults: ``sat caption``'s)."""

    beam_size: int = 3
    max_length: int = 20
    length_penalty: float = 1.0
    mode: str = "expected"
    batch_size: int = 16
