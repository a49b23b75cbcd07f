"""Caption tokenisation, shared by training data and scoring.

The rule: NFKC-normalise, lower-case, keep maximal runs of letters and digits, drop everything
else. Apostrophes and hyphens are separators, so ``"horse's"`` gives ``horse s`` and
``"tri-colored"`` gives ``tri colored``: exactly the tokens of Karpathy's split files
(``dataset_*.json``), which most captioning code trains on.

Scoring re-tokenises hypotheses and references with pycocoevalcap's PTBTokenizer (Stanford
CoreNLP 3.4.1, ``-lowerCase``, punctuation tokens removed). On text made of lower-case
alphanumeric words separated by spaces that tokenizer is the identity except for six
contractions it splits (``cannot`` -> ``can not``, ``gonna`` -> ``gon na``, ...). We split
those the same way here, so ``tokenize`` output joined with spaces survives PTB unchanged and
a caption is scored on the tokens it was trained on. That split is the one documented
difference from Karpathy's tokens.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["PTB_SPLITS", "detokenize", "tokenize"]

# Stanford PTBLexer splits these words even without an apostrophe (checked against the
# stanford-corenlp-3.4.1.jar that pycocoevalcap ships).
PTB_SPLITS: dict[str, tuple[str, str]] = {
    "cannot": ("can", "not"),
    "gimme": ("gim", "me"),
    "gonna": ("gon", "na"),
    "gotta": ("got", "ta"),
    "lemme": ("lem", "me"),
    "wanna": ("wan", "na"),
}

# letters and digits of any script ("_" is a word character for \w but not for us), plus the
# combining diacritics that lower-casing can leave behind ("İ".lower() is "i" + U+0307)
_WORD = re.compile(r"(?:[^\W_]|[\u0300-\u036f])+")


def tokenize(text: str) -> list[str]:
    """Split a caption into lower-case alphanumeric tokens (see the module docstring)."""
    # NFKC folds compatibility forms ("ﬁ" -> "fi", "²" -> "2") so PTB sees the same letters
    words = _WORD.findall(unicodedata.normalize("NFKC", text).lower())
    tokens: list[str] = []
    for word in words:
        tokens.extend(PTB_SPLITS.get(word, (word,)))
    return tokens


def detokenize(tokens: list[str]) -> str:
    """Join tokens into the string handed to the scorer; ``tokenize`` of it gives ``tokens``."""
    return " ".join(tokens)
