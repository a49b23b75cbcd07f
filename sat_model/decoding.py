"""Free-running decoding: greedy and batched beam search over log-probabilities.

Dimensions (PAPER.md): ``B`` images, ``k`` beams, ``L`` annotation locations, ``K`` vocabulary
size, ``t`` steps decoded so far.

``max_length`` bounds the number of decoding steps, ``<end>`` included: a caption that reaches
``<end>`` has at most ``max_length - 1`` words; one that never does has exactly ``max_length``
words and ``finished=False``. Scores are summed log-probabilities (log_softmax, never raw
logits) of every emitted token, ``<end>`` included when it was reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sat_model.model import END_ID, MODES, START_ID, DecoderState, ShowAttendTell

__all__ = ["Caption", "beam_search", "greedy"]


@dataclass(frozen=True)
class Caption:
    tokens: list[int]  # word ids, without <start>/<end>
    score: float  # summed log-probabilities, <end> included when reached
    alphas: np.ndarray  # (len(tokens), L): the attention while each word was emitted
    finished: bool = True  # False when max_length ran out before <end>


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


def _captions(tokens: np.ndarray, alphas: np.ndarray, scores: np.ndarray) -> list[Caption]:
    """Cut each row at its first <end>: tokens (N, t), alphas (N, t, L), scores (N,)."""
    captions = []
    for row, scores_row in zip(tokens, scores, strict=True):
        ends = np.flatnonzero(row == END_ID)
        n = int(ends[0]) if ends.size else row.size
        captions.append(
            Caption(
                tokens=row[:n].tolist(),
                score=float(scores_row),
                alphas=alphas[len(captions), :n],
                finished=bool(ends.size),
            )
        )
    return captions


def beam_search(
    model: ShowAttendTell,
    annotations: Tensor,
    beam_size: int,
    max_length: int,
    length_normalization: bool = False,
    mode: str = "expected",
) -> list[Caption]:
    """Beam search with all B images × k beams advancing as one batch of B*k rows.

    Finished beams stay in the beam, extended by ``<end>`` at no cost, so they compete with the
    unfinished ones on equal terms. The result per image is the best finished hypothesis (score
    divided by its length when ``length_normalization``), or the best unfinished one when none
    finished. With ``beam_size=1`` this is greedy decoding.
    """
    _check_args(annotations, max_length, mode, beam_size)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return _beam_search(
                model, annotations, beam_size, max_length, length_normalization, mode
            )
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class _Beams:
    tokens: Tensor  # (B*k, t)
    alphas: Tensor  # (B*k, t, L)
    scores: Tensor  # (B, k)
    finished: Tensor  # (B*k,) bool
    state: DecoderState


def _beam_search(
    model: ShowAttendTell,
    annotations: Tensor,
    k: int,
    max_length: int,
    length_normalization: bool,
    mode: str,
) -> list[Caption]:
    B, L, _ = annotations.shape
    device = annotations.device
    # W_a a and h_0, c_0 once per image, then copied to the image's k rows: (B*k, …)
    state = model.init_state(annotations).repeat(k)
    scores = torch.full((B, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # one live beam per image at first, or the k beams would be duplicates
    beams = _Beams(
        tokens=torch.empty(B * k, 0, dtype=torch.long, device=device),
        alphas=torch.empty(B * k, 0, L, device=device),
        scores=scores,
        finished=torch.zeros(B * k, dtype=torch.bool, device=device),
        state=state,
    )
    prev = torch.full((B * k,), START_ID, dtype=torch.long, device=device)
    for _ in range(max_length):
        beams = _advance(model, beams, prev, k, mode)
        prev = beams.tokens[:, -1]
        # one sync per step buys stopping as soon as every beam has ended
        if bool(beams.finished.all()):
            break
    return _best_captions(beams, k, length_normalization)


def _advance(model: ShowAttendTell, beams: _Beams, prev: Tensor, k: int, mode: str) -> _Beams:
    """One step for all B*k rows: extend, keep the k best of k*K per image, reorder."""
    out = model.step(prev, beams.state, mode)
    log_probs = torch.log_softmax(out.logits.float(), dim=-1)  # (B*k, K)
    K = log_probs.size(1)
    # a finished beam may only continue with <end>, at log-probability 0
    ended = torch.full_like(log_probs[:1], float("-inf"))
    ended[0, END_ID] = 0.0
    log_probs = torch.where(beams.finished.unsqueeze(1), ended, log_probs)
    B = beams.scores.size(0)
    candidates = (beams.scores.view(B * k, 1) + log_probs).view(B, k * K)  # (B, k*K)
    scores, flat = candidates.topk(k, dim=1)  # (B, k)
    parent = torch.div(flat, K, rounding_mode="floor")  # (B, k), beam index within the image
    token = (flat % K).view(B * k)  # (B*k,)
    rows = (torch.arange(B, device=flat.device).unsqueeze(1) * k + parent).view(B * k)  # (B*k,)
    return _Beams(
        tokens=torch.cat([beams.tokens[rows], token.unsqueeze(1)], dim=1),  # (B*k, t+1)
        alphas=torch.cat([beams.alphas[rows], out.alpha[rows].unsqueeze(1)], dim=1),
        scores=scores,
        finished=beams.finished[rows] | (token == END_ID),
        state=out.state.reorder(rows),
    )


def _best_captions(beams: _Beams, k: int, length_normalization: bool) -> list[Caption]:
    """The best hypothesis of each image, as a Caption."""
    B = beams.scores.size(0)
    tokens = beams.tokens.cpu().numpy()  # (B*k, t)
    is_end = tokens == END_ID
    finished = is_end.any(1)  # (B*k,)
    # emitted length: the words before the first <end>, plus that <end>
    length = np.where(finished, is_end.argmax(1) + 1, tokens.shape[1]).reshape(B, k)
    finished = finished.reshape(B, k)
    scores = beams.scores.float().cpu().numpy()  # (B, k)
    rank = scores / length if length_normalization else scores
    # prefer finished hypotheses; fall back to unfinished ones only where none finished
    eligible = finished | ~finished.any(1, keepdims=True)
    best = np.where(eligible, rank, -np.inf).argmax(1)  # (B,)
    rows = np.arange(B) * k + best  # (B,)
    alphas = beams.alphas[torch.as_tensor(rows, device=beams.alphas.device)]  # (B, t, L)
    return _captions(tokens[rows], alphas.float().cpu().numpy(), scores[np.arange(B), best])
