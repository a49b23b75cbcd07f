"""Greedy and batched beam search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sat_model.data.vocab import END_ID, START_ID
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import Caption, beam_search, greedy
from sat_model.model.kernels import build_backend
from tests.factories import model_config

K, D, L = 15, 6, 5


def random_model(
    seed: int, attention: str = "soft", end_bias: float = 0.0, vocab_size: int = K
) -> ShowAttendTell:
    """A random model; a positive ``end_bias`` makes captions end after a few words."""
    torch.manual_seed(seed)
    config = model_config(
        vocab_size=vocab_size, annotation_dim=D, num_locations=L, dropout=0.3, attention=attention
    )
    model = ShowAttendTell(config, build_backend("native"))
    with torch.no_grad():
        model.out.weight.mul_(3.0)  # peaked word distributions, as in a trained model
        model.out.bias[END_ID] += end_bias
    return model


def random_annotations(seed: int, batch: int = 6) -> torch.Tensor:
    return torch.randn(batch, L, D, generator=torch.Generator().manual_seed(seed))


def teacher_forced_score(model: ShowAttendTell, annotations: torch.Tensor, c: Caption) -> float:
    """Σ log p(y_t | …) of the caption's tokens (and <end> when finished), by teacher forcing."""
    ids = [START_ID, *c.tokens] + ([END_ID] if c.finished else [])
    model.eval()
    with torch.no_grad():
        logits = model(annotations.unsqueeze(0), torch.tensor([ids])).logits[0]  # (T, K)
    targets = torch.tensor(ids[1:]).unsqueeze(1)  # (T, 1)
    log_probs = torch.log_softmax(logits, -1).gather(1, targets)
    return float(log_probs.sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_beam_search_with_k1_equals_greedy(seed: int, attention: str) -> None:
    model = random_model(seed, attention, end_bias=2.0)
    annotations = random_annotations(seed)
    expected = greedy(model, annotations, max_length=12)
    actual = beam_search(model, annotations, beam_size=1, max_length=12)
    for g, b in zip(expected, actual, strict=True):
        assert b.tokens == g.tokens and b.finished == g.finished
        assert b.score == pytest.approx(g.score, abs=1e-5)
        np.testing.assert_allclose(b.alphas, g.alphas, atol=1e-6)


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("end_bias", [2.0, -1e4])
def test_beam_scores_equal_teacher_forced_log_probabilities(
    beam_size: int, end_bias: float
) -> None:
    model = random_model(3, end_bias=end_bias)
    annotations = random_annotations(3)
    captions = beam_search(model, annotations, beam_size=beam_size, max_length=8)
    for image, c in zip(annotations, captions, strict=True):
        assert c.score == pytest.approx(teacher_forced_score(model, image, c), abs=1e-4)
    greedy_captions = greedy(model, annotations, max_length=8)
    for image, c in zip(annotations, greedy_captions, strict=True):
        assert c.score == pytest.approx(teacher_forced_score(model, image, c), abs=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_beam_search_k3_never_scores_worse_than_greedy(seed: int) -> None:
    model = random_model(seed, end_bias=3.0)
    annotations = random_annotations(seed, batch=8)
    greedy_captions = greedy(model, annotations, max_length=15)
    beam_captions = beam_search(model, annotations, beam_size=3, max_length=15)
    for g, b in zip(greedy_captions, beam_captions, strict=True):
        assert g.finished and b.finished
        assert b.score >= g.score - 1e-5


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_a_beam_wider_than_every_prefix_finds_the_exhaustive_best(length_penalty: float) -> None:
    # 4 words and 3 steps: at most 4^3 = 64 hypotheses, so a beam of 64 prunes nothing (the
    # beam starts with one row per image and is narrower than k until the vocabulary has filled
    # it). The result must be the best finished caption over every word sequence, scored by
    # teacher forcing
    vocab, steps = 4, 3
    model = random_model(8, end_bias=1.0, vocab_size=vocab)
    annotations = random_annotations(8, batch=3)
    found = beam_search(model, annotations, vocab**steps, steps, length_penalty)
    words = [i for i in range(vocab) if i != END_ID]  # <pad> and <start> are words to the model
    # every caption that ends within the steps: 0, 1 or 2 words, then <end>
    every = [list(ids) for n in range(steps) for ids in itertools.product(words, repeat=n)]
    for image, c in zip(annotations, found, strict=True):

        def rank(ids: list[int], image: torch.Tensor = image) -> float:
            caption = Caption(tokens=ids, score=0.0, alphas=np.zeros((len(ids), L)))
            score = teacher_forced_score(model, image, caption)
            return score / (len(ids) + 1) ** length_penalty  # + 1: <end>

        assert c.finished and c.tokens == max(every, key=rank)
        assert c.score == pytest.approx(teacher_forced_score(model, image, c), abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_unreachable_end_returns_max_length_captions(beam_size: int) -> None:
    model = random_model(0, end_bias=-1e4)  # <end> can never win
    annotations = random_annotations(0)
    for decode in (
        lambda: greedy(model, annotations, max_length=7),
        lambda: beam_search(model, annotations, beam_size=beam_size, max_length=7),
    ):
        for c in decode():
            assert len(c.tokens) == 7 and not c.finished
            assert c.alphas.shape == (7, L)
            assert np.isfinite(c.score)


@pytest.mark.parametrize(("attention", "mode"), [("soft", "expected"), ("hard", "argmax")])
def test_batched_beam_search_equals_one_image_at_a_time(attention: str, mode: str) -> None:
    # the k beams of an image share one copy of its annotations: each beam must attend to (and,
    # with argmax, pick a location of) its own image's annotations, never a neighbour's
    model = random_model(4, attention, end_bias=2.0)
    annotations = random_annotations(4)
    batched = beam_search(model, annotations, beam_size=3, max_length=10, mode=mode)
    for image, b in zip(annotations, batched, strict=True):
        (alone,) = beam_search(model, image.unsqueeze(0), beam_size=3, max_length=10, mode=mode)
        assert alone.tokens == b.tokens
        assert alone.score == pytest.approx(b.score, abs=1e-5)
        np.testing.assert_allclose(alone.alphas, b.alphas, atol=1e-6)


def test_batched_and_one_image_decoding_agree_at_the_papers_sizes() -> None:
    # the paper's decoder (m, n, A = 512, 1800, 512; L = 196, D = 512; K = 10,000), random
    # weights, through the compiled attention step
    torch.manual_seed(0)
    config = model_config(  # the paper's sizes
        vocab_size=10_000,
        annotation_dim=512,
        num_locations=196,
        embed_dim=512,
        hidden_dim=1800,
        attention_dim=512,
        dropout=0.5,
    )
    model = ShowAttendTell(config, build_backend("native"))
    with torch.no_grad():
        model.out.weight.mul_(3.0)
    annotations = torch.randn(3, 196, 512, generator=torch.Generator().manual_seed(0))
    batched = beam_search(model, annotations, beam_size=3, max_length=5)
    for image, b in zip(annotations, batched, strict=True):
        (alone,) = beam_search(model, image.unsqueeze(0), beam_size=3, max_length=5)
        assert alone.tokens == b.tokens
        assert alone.score == pytest.approx(b.score, abs=1e-4)
        np.testing.assert_allclose(alone.alphas, b.alphas, atol=1e-6)


def test_captions_carry_one_attention_map_per_word() -> None:
    model = random_model(5, end_bias=2.0)
    for c in beam_search(model, random_annotations(5), beam_size=3, max_length=10):
        assert c.alphas.shape == (len(c.tokens), L)
        np.testing.assert_allclose(c.alphas.sum(-1), 1.0, rtol=1e-5)
        assert END_ID not in c.tokens and START_ID not in c.tokens


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_a_length_penalty_picks_the_best_score_per_length_to_its_power(
    length_penalty: float,
) -> None:
    model = random_model(6, end_bias=0.5)
    annotations = random_annotations(6)
    search = dict(beam_size=4, max_length=12)
    plain = beam_search(model, annotations, **search)
    per_token = beam_search(model, annotations, **search, length_penalty=1.0)
    ranked = beam_search(model, annotations, **search, length_penalty=length_penalty)
    longer = 0
    for p, t, r in zip(plain, per_token, ranked, strict=True):
        # same beams, different pick (lengths count <end>): the plain pick has the best sum, the
        # ranked one the best sum / length^penalty, and a larger penalty never picks a shorter
        # caption than a smaller one
        assert p.score >= r.score - 1e-5
        assert r.score / (len(r.tokens) + 1) ** length_penalty >= (
            p.score / (len(p.tokens) + 1) ** length_penalty - 1e-5
        )
        assert len(p.tokens) <= len(t.tokens) <= len(r.tokens)
        longer += len(r.tokens) > len(p.tokens)
    assert longer > 0  # the seed gives beams where the penalty changes the pick


@pytest.mark.parametrize("mode", ["sample", "argmax"])
def test_hard_attention_decodes_with_sampled_or_argmax_locations(mode: str) -> None:
    model = random_model(7, "hard", end_bias=2.0)
    annotations = random_annotations(7)
    for c in beam_search(model, annotations, beam_size=2, max_length=6, mode=mode):
        assert c.alphas.shape == (len(c.tokens), L)
        assert np.isfinite(c.score)


def test_decoding_restores_training_mode_and_rejects_bad_arguments() -> None:
    model = random_model(0).train()
    greedy(model, random_annotations(0), max_length=3)
    assert model.training
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, random_annotations(0), beam_size=0, max_length=3)
    with pytest.raises(ValueError, match="'train'"):
        greedy(model, random_annotations(0), max_length=3, mode="train")
    with pytest.raises(ValueError, match="max_length"):
        greedy(model, random_annotations(0), max_length=0)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(model, random_annotations(0), beam_size=2, max_length=3, length_penalty=-1)
