"""Tokenisation: Karpathy-compatible tokens that PTB re-tokenisation leaves unchanged."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sat_model.data.text import PTB_SPLITS, detokenize, tokenize
from sat_model.paths import shared_data

SAMPLE = shared_data("flickr8k-sample")


def test_tokenize_lowercases_and_drops_punctuation() -> None:
    assert tokenize("A Dog runs, fast!  ") == ["a", "dog", "runs", "fast"]


def test_tokenize_splits_apostrophes_and_hyphens_like_karpathy() -> None:
    # Karpathy's dataset_flickr8k.json tokens for these raw captions (README of the sample)
    assert tokenize("a girl holding a horse 's lead") == [
        "a",
        "girl",
        "holding",
        "a",
        "horse",
        "s",
        "lead",
    ]
    assert tokenize("a tri-colored dog") == ["a", "tri", "colored", "dog"]


def test_tokenize_of_empty_or_punctuation_only_text_is_empty() -> None:
    assert tokenize("") == []
    assert tokenize(" ... ; -- ") == []


def test_tokenize_treats_underscore_as_separator() -> None:
    assert tokenize("snake_case") == ["snake", "case"]


def test_tokenize_keeps_accented_letters_in_one_token() -> None:
    assert tokenize("Café NAÏVE İstanbul") == ["café", "naïve", "i̇stanbul"]


def test_tokenize_splits_contractions_the_way_ptb_does() -> None:
    assert tokenize("I cannot, we gonna") == ["i", "can", "not", "we", "gon", "na"]
    assert set(PTB_SPLITS) == {"cannot", "gimme", "gonna", "gotta", "lemme", "wanna"}


def test_tokenize_of_detokenized_tokens_is_identity() -> None:
    tokens = tokenize("Two dogs' owners can't stop: they're 3-to-1 winners (really)!")
    assert tokenize(detokenize(tokens)) == tokens


def test_tokenize_equals_karpathy_tokens_on_flickr8k_sample() -> None:
    if not (SAMPLE / "dataset_flickr8k.json").is_file():
        pytest.skip(f"shared Flickr8k sample not found at {SAMPLE}")
    images = json.loads((SAMPLE / "dataset_flickr8k.json").read_text())["images"]
    sentences = [s for im in images for s in im["sentences"]]
    # no PTB contraction occurs in this sample, so the tokens must agree exactly
    mismatches = [s["raw"] for s in sentences if tokenize(s["raw"]) != s["tokens"]]
    assert len(sentences) == 11_250
    assert mismatches == []


@pytest.mark.java
def test_ptb_tokenizer_leaves_our_tokens_unchanged() -> None:
    if shutil.which("java") is None:
        pytest.skip("no java runtime: the PTB tokenizer needs one")
    import pycocoevalcap.tokenizer.ptbtokenizer as ptb

    jar = Path(ptb.__file__).with_name(ptb.STANFORD_CORENLP_3_4_1_JAR)
    raw = [
        "A dog's toy; a tri-colored ball (red/blue) at 3:30 p.m.",
        "We cannot stop, gonna gotta lemme gimme wanna go!",
        'Café, naïve ﬁsh & chips -- 1,000 ½ `quoted\' "double"',
        "Two dogs ... run",
    ]
    lines = [detokenize(tokenize(r)) for r in raw]
    # the exact command pycocoevalcap runs (PTBTokenizer.tokenize), fed on stdin
    out = subprocess.run(
        [
            "java",
            "-cp",
            str(jar),
            "edu.stanford.nlp.process.PTBTokenizer",
            "-preserveLines",
            "-lowerCase",
        ],
        input="\n".join(lines),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    retokenized = [
        " ".join(w for w in line.split(" ") if w not in ptb.PUNCTUATIONS) for line in out
    ]
    assert retokenized == lines
