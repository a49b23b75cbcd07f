"""score_captions returns pycocoevalcap's own numbers and never hangs on a stuck METEOR."""

from __future__ import annotations

import shutil
import time

import pytest

from sat_model.evaluation.metrics import MetricError, MetricTimeoutError, score_captions

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="no Java runtime on PATH")

REFS = {
    "img1": ["A dog runs across the green field.", "a brown dog running on grass"],
    "img2": ["Two children play with a red ball", "kids playing ball in a park", "two kids"],
    "img3": ["a man rides a bicycle down the street"],
}
HYPS = {
    "img1": "a dog running on the grass",
    "img2": "two children playing with a ball",
    "img3": "a man riding a bike on a street",
}


def _reference_scores() -> dict[str, float]:
    # pycocoevalcap called the way COCOEvalCap.evaluate does, independently of the wrapper
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in v] for k, v in REFS.items()})
    res = tok.tokenize({k: [{"caption": h}] for k, h in HYPS.items()})
    bleu, _ = Bleu(4).compute_score(gts, res)
    out = {f"bleu_{i + 1}": b for i, b in enumerate(bleu)}
    out["meteor"] = Meteor().compute_score(gts, res)[0]
    out["rouge_l"] = Rouge().compute_score(gts, res)[0]
    out["cider"] = Cider().compute_score(gts, res)[0]
    return out


@pytest.mark.java
@pytest.mark.slow
@needs_java
def test_score_captions_equals_pycocoevalcap_scorers_called_directly() -> None:
    expected = _reference_scores()
    got = score_captions(HYPS, REFS)
    assert set(got) == {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor", "rouge_l", "cider"}
    assert got == expected


@pytest.mark.java
@needs_java
def test_bleu_4_is_one_for_a_hypothesis_identical_to_its_only_reference() -> None:
    refs = {"a": ["a black cat sits on a red mat"], "b": ["two dogs play in the snow today"]}
    hyps = {k: v[0] for k, v in refs.items()}
    got = score_captions(hyps, refs, metrics=("bleu",))
    assert set(got) == {"bleu_1", "bleu_2", "bleu_3", "bleu_4"}
    # pycocoevalcap adds tiny epsilons to its n-gram counts, hence approx
    assert got["bleu_4"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.java
@needs_java
def test_scoring_prints_nothing_and_keeps_captions_with_line_breaks_in_place(capfd) -> None:
    # a line break inside a reference would, fed to the line-based tokenizer as it is, shift
    # every later caption onto the wrong image
    refs = {"a": ["a black cat\nsits on a red mat"], "b": ["two dogs play\r\nin the snow today"]}
    hyps = {"a": "a black cat sits on a red mat", "b": "two dogs play in the snow today"}
    got = score_captions(hyps, refs, metrics=("bleu",))
    assert got["bleu_4"] == pytest.approx(1.0, abs=1e-6)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")  # no "PTBTokenizer tokenized N tokens" on the terminal


def test_a_tokenizer_without_java_fails_with_a_metric_error(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MetricError, match="needs Java on PATH"):
        score_captions({"a": "a cat"}, {"a": ["a cat"]}, metrics=("bleu",))


@pytest.mark.java
@needs_java
def test_bleu_4_is_zero_when_no_word_matches() -> None:
    refs = {"a": ["a black cat sits on a red mat"]}
    got = score_captions({"a": "green trees under blue skies today"}, refs, metrics=("bleu",))
    assert got["bleu_4"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.java
@needs_java
def test_meteor_timeout_kills_a_stuck_process_and_says_so() -> None:
    # `sleep` reads nothing and answers nothing: the scorer's readline blocks like a stuck JVM
    start = time.monotonic()
    with pytest.raises(MetricTimeoutError, match=r"METEOR timed out after 1 s"):
        score_captions(
            HYPS, REFS, metrics=("meteor",), meteor_timeout_s=1.0, meteor_command=["sleep", "60"]
        )
    assert time.monotonic() - start < 20


def test_unknown_metric_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="spice"):
        score_captions(HYPS, REFS, metrics=("bleu", "spice"))


def test_hypotheses_without_references_are_refused_with_their_ids() -> None:
    with pytest.raises(ValueError, match="imgX"):
        score_captions({**HYPS, "imgX": "a cat"}, REFS, metrics=("bleu",))


def test_image_with_no_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="img3"):
        score_captions(HYPS, {**REFS, "img3": []}, metrics=("bleu",))
