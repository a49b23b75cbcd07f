"""Self-critical training (``sat_model.train.self_critical``): its reward, sampler, baseline and
gradient, each against an independent account of what it should compute."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from sat_model.data.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from sat_model.model.decoding import sample
from sat_model.model.losses import SelfCriticalLoss
from sat_model.train.self_critical import (
    CiderD,
    Reward,
    SampledBatch,
    leave_one_out_advantages,
    self_critical_step,
    sentence_bleu,
)
from tests.factories import TINY_K as K
from tests.factories import tiny_batch, tiny_model


def _corpus(seed: int = 0) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, tuple[int, ...]]]:
    """12 images, 5 references each and one hypothesis, over a 10-word vocabulary, <end> last."""
    rng = np.random.default_rng(seed)

    def caption() -> tuple[int, ...]:
        words = rng.integers(4, 14, size=int(rng.integers(3, 9)))
        return (*[int(w) for w in words], END_ID)

    refs = {i: [caption() for _ in range(5)] for i in range(12)}
    # a hypothesis that shares a few references' words, so that the n-gram orders all score
    hyps = {i: refs[i][i % 5][: 2 + i % 4] + caption() for i in range(12)}
    return refs, hyps


def test_cider_d_equals_pycocoevalcap_when_the_corpus_is_the_scored_set() -> None:
    """pycocoevalcap's CIDEr-D takes its document frequencies from the references it scores; with
    those references being the whole corpus, both must give the same score for every image."""
    from pycocoevalcap.cider.cider import Cider

    refs, hyps = _corpus()
    words = {i: [" ".join(map(str, r)) for r in rs] for i, rs in refs.items()}
    res = {i: [" ".join(map(str, h))] for i, h in hyps.items()}
    _, expected = Cider().compute_score(words, res)
    reward = CiderD(refs)
    got = [reward.score(i, hyps[i]) for i in sorted(refs)]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert max(got) > 0.5  # the hypotheses do overlap their references
    assert reward.score(0, refs[0][0]) > max(got)  # a reference itself scores highest


def test_cider_d_keeps_the_corpus_frequencies_for_any_batch() -> None:
    """The frequencies are the corpus's, so an image's score does not depend on which other
    images are scored with it (pycocoevalcap's would)."""
    refs, hyps = _corpus(1)
    reward = CiderD(refs)
    alone = reward.score(3, hyps[3])
    for i in range(12):
        reward.score(i, hyps[i])
    assert reward.score(3, hyps[3]) == alone
    with pytest.raises(ValueError, match="at least one"):
        CiderD({})


def sentence_bleu_4(
    references: Sequence[Sequence[Sequence[int]]], captions: Sequence[Sequence[int]]
) -> list[float]:
    return [b[3] for b in sentence_bleu(references, captions)]


def test_sentence_bleu_by_hand() -> None:
    """All four n-gram precisions 1 and 5 words against the closest reference's 6: every order
    is the brevity penalty exp(1 - 6/5); a reference itself scores 1; <end> is not a word."""
    refs = [(5, 6, 7, 8, 9, 10, END_ID), (11, 12, END_ID)]
    got = sentence_bleu([refs, refs, refs], [(5, 6, 7, 8, 9, END_ID), refs[0], (5, 6, 7, 8, 9)])
    short = np.exp(1 - 6 / 5)
    np.testing.assert_allclose(got, [[short] * 4, [1.0] * 4, [short] * 4], rtol=1e-6)
    # one word of two matches (closest reference 2 words: no brevity penalty) and no 2-gram:
    # BLEU-1 is the unigram precision 1/2, the 4-gram score pycocoevalcap's ~0
    (one,) = sentence_bleu([refs], [(11, 4, END_ID)])
    assert one[0] == pytest.approx(0.5) and one[3] < 1e-3


def test_sentence_bleu_4_equals_pycocoevalcap_per_caption_on_word_strings() -> None:
    from pycocoevalcap.bleu.bleu import Bleu

    refs, hyps = _corpus(2)

    def words(tokens: tuple[int, ...]) -> str:
        return " ".join(f"w{t}" for t in tokens if t != END_ID)

    gts = {i: [words(r) for r in rs] for i, rs in refs.items()}
    res = {i: [words(h)] for i, h in hyps.items()}
    _, expected = Bleu(4).compute_score(gts, res, verbose=0)
    got = sentence_bleu_4([refs[i] for i in sorted(refs)], [hyps[i] for i in sorted(refs)])
    np.testing.assert_allclose(got, expected[3], rtol=1e-12)
    assert max(got) > 0.1
    by_order = sentence_bleu([refs[i] for i in sorted(refs)], [hyps[i] for i in sorted(refs)])
    np.testing.assert_allclose(np.array(by_order).T, expected, rtol=1e-12)  # BLEU-1..4


def test_the_reward_adds_the_weighted_bleu_4_to_cider_d() -> None:
    """Captions as drawn (<start>, padding after <end>) are scored on their words and <end>."""
    refs, hyps = _corpus(3)
    images = [0, 0, 5, 7]
    longest = max(refs[0], key=len)  # 4 words or more: it has a 4-gram to match
    assert len(longest) > 4
    words = [hyps[0], longest, hyps[5], hyps[7]]  # each ends with <end>
    drawn = [(START_ID, *w, *[PAD_ID] * k) for k, w in enumerate(words)]
    cider = CiderD(refs)
    plain = torch.tensor([cider.score(i, w) for i, w in zip(images, words, strict=True)])
    bleu = torch.tensor(sentence_bleu_4([refs[i] for i in images], words))
    torch.testing.assert_close(Reward(refs)(images, drawn), plain)
    torch.testing.assert_close(Reward(refs, bleu_weight=0.5)(images, drawn), plain + 0.5 * bleu)
    assert bleu[1].item() == pytest.approx(1.0)  # a reference drawn word for word
    assert 0 <= bleu.min() < bleu.max()  # the captions' BLEU-4 differ
    bleu_1 = torch.tensor([b[0] for b in sentence_bleu([refs[i] for i in images], words)])
    both = Reward(refs, bleu_weight=0.5, bleu1_weight=2.0)(images, drawn)
    torch.testing.assert_close(both, plain + 0.5 * bleu + 2.0 * bleu_1)
    assert (bleu_1 > bleu).any()  # BLEU-1 is its own term, not BLEU-4 again
    with pytest.raises(ValueError, match="bleu_weight"):
        Reward(refs, bleu_weight=-1.0)
    with pytest.raises(ValueError, match="bleu1_weight"):
        Reward(refs, bleu1_weight=-1.0)


def test_a_drawn_unk_matches_no_reference_unk() -> None:
    """The evaluation scores words, and a reference's rare word is never "<unk>": a drawn <unk>
    must score as a word that no reference holds, not as a match of the references' <unk>."""
    refs, _ = _corpus(4)
    refs[0] = [(4, 5, UNK_ID, 6, 7, END_ID)] * 2 + refs[0][2:]  # a rare word, held as <unk>
    absent = 99  # in no reference of the corpus
    assert all(absent not in r for rs in refs.values() for r in rs)
    drawn, stranger = [(START_ID, 4, 5, w, 6, 7, END_ID) for w in (UNK_ID, absent)]
    for weight in (0.0, 1.0):
        reward = Reward(refs, bleu_weight=weight)
        torch.testing.assert_close(reward([0], [drawn]), reward([0], [stranger]))
    # scored on ids, the <unk> would have matched two references word for word
    reward = Reward(refs, bleu_weight=1.0)
    as_ids = CiderD(refs).score(0, drawn[1:]) + sentence_bleu_4([refs[0]], [drawn[1:]])[0]
    assert as_ids > reward([0], [drawn]).item() + 1.0


def test_leave_one_out_advantages_subtract_the_mean_of_the_other_samples() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])  # two images, three samples each
    got = leave_one_out_advantages(rewards, 3)
    expected = torch.tensor([1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 3.0, 0 - 3.0, 6 - 0.0])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.view(2, 3).sum(1), torch.zeros(2))  # zero-sum per image
    with pytest.raises(ValueError, match=">= 2 samples"):
        leave_one_out_advantages(rewards, 1)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_sampled_first_words_follow_each_images_own_distribution(attention: str) -> None:
    """4,000 draws per image: the first word's frequencies are p(y_1 | a) of that image (the
    decoding step's softmax over every word but <pad> and <start>), within sampling error, and
    the two images' differ."""
    torch.manual_seed(0)
    model = tiny_model(attention).eval()
    with torch.no_grad():  # sharper distributions, so that the images differ clearly
        model.out.weight.mul_(8.0)
    annotations = tiny_batch()[0][:2]
    n = 4000
    captions = sample(model, annotations, n, max_length=3)
    assert captions.shape[0] == 2 * n and (captions[:, 0] == START_ID).all()
    state = model.init_state(annotations)
    with torch.no_grad():
        step = model.step(torch.full((2,), START_ID), state, "expected")
    logits = step.logits.clone()
    logits[:, [PAD_ID, START_ID]] = float("-inf")  # never targets, never drawn
    probs = torch.softmax(logits, -1)  # (2, K)
    for image in range(2):
        first = captions[image * n : (image + 1) * n, 1]
        freq = torch.bincount(first, minlength=K).float() / n
        torch.testing.assert_close(freq, probs[image], atol=0.03, rtol=0)
    assert (probs[0] - probs[1]).abs().max() > 0.1


def test_samples_are_padded_after_their_end_and_stop_when_all_have_ended() -> None:
    torch.manual_seed(0)
    model = tiny_model().eval()
    with torch.no_grad():
        model.out.bias.zero_()
        model.out.bias[END_ID] = 3.0  # <end> at about two draws in three
    captions = sample(model, tiny_batch()[0], 8, max_length=12)
    ended = False
    for row in captions.tolist():
        assert row[0] == START_ID
        ends = [t for t, tok in enumerate(row) if tok == END_ID]
        if ends:
            assert all(tok == PAD_ID for tok in row[ends[0] + 1 :])
            assert PAD_ID not in row[: ends[0]]
            ended = True
        else:
            assert len(row) == 13 and PAD_ID not in row  # max_length words, none ended
    assert ended
    # every row had ended before the 12 steps ran out: the loop stopped early
    short = sample(model, tiny_batch()[0], 2, max_length=12)
    assert (short == END_ID).any(1).all() == (short.shape[1] < 13)
    with pytest.raises(ValueError, match="num_samples"):
        sample(model, tiny_batch()[0], 0, max_length=3)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_a_self_critical_step_raises_the_better_caption_and_lowers_the_worse(
    attention: str,
) -> None:
    """Two captions of one image, advantages +1 and -1: a few SGD steps on the loss raise the
    first caption's log-probability and lower the second's, and training mode (dropout) is
    off during the pass and back on after it."""
    torch.manual_seed(0)
    model = tiny_model(attention, dropout=0.5).train()
    annotations, captions = tiny_batch()
    batch = SampledBatch(
        annotations=annotations[:1],
        captions=captions[:2],
        advantages=torch.tensor([1.0, -1.0]),
        num_samples=2,
    )

    def log_probs() -> list[float]:
        with torch.no_grad():
            out = model.eval()(annotations[:1].repeat(2, 1, 1), batch.captions, mode="expected")
        model.train()
        logp = torch.log_softmax(out.logits, -1).gather(2, captions[:2, 1:, None]).squeeze(2)
        return (logp * (captions[:2, 1:] != PAD_ID)).sum(1).tolist()

    before = log_probs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        optimizer.zero_grad()
        out = self_critical_step(model, SelfCriticalLoss(), batch)
        assert model.training
        out.loss.backward()
        optimizer.step()
    after = log_probs()
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
