"""Word vocabulary: stable ids, the ``vocab.json`` format, encoding and decoding.

Ids are positions in ``itos``: ``<pad>`` = 0, ``<start>`` = 1, ``<end>`` = 2, ``<unk>`` = 3
(:data:`PAD_ID` ..., the one place they are defined),
then words by descending training count, ties alphabetical, so the same captions always give
the same ids. ``max_size`` counts the whole list (K in docs/METHOD.md, 10,000 in the paper),
specials included.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sat_model.atomic import write_text_atomic

__all__ = [
    "END",
    "END_ID",
    "FORMAT_VERSION",
    "PAD",
    "PAD_ID",
    "SPECIALS",
    "START",
    "START_ID",
    "UNK",
    "UNK_ID",
    "Vocab",
    "VocabError",
    "build_vocab",
    "load_vocab",
    "save_vocab",
]

FORMAT_VERSION = 1
PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS: tuple[str, ...] = (PAD, START, END, UNK)
# their ids (positions in SPECIALS), fixed by the vocab.json contract: the model, decoding and the
# losses use these, every vocabulary starts with SPECIALS
PAD_ID, START_ID, END_ID, UNK_ID = range(len(SPECIALS))


class VocabError(ValueError):
    """Raised for an invalid vocabulary file or arguments; the message names the bad value."""


@dataclass(frozen=True)
class Vocab:
    """An id <-> word mapping plus the limits it was built with."""

    itos: tuple[str, ...]
    min_count: int
    max_size: int
    max_caption_length: int
    stoi: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.itos[: len(SPECIALS)] != SPECIALS:
            raise VocabError(f"vocabulary must start with {SPECIALS}, got {self.itos[:4]}")
        if len(set(self.itos)) != len(self.itos):
            dup = sorted(w for w, c in Counter(self.itos).items() if c > 1)
            raise VocabError(f"vocabulary repeats words: {dup[:5]}")
        object.__setattr__(self, "stoi", {w: i for i, w in enumerate(self.itos)})

    def __len__(self) -> int:
        return len(self.itos)

    pad_id, start_id, end_id, unk_id = PAD_ID, START_ID, END_ID, UNK_ID

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Word ids of ``tokens`` (unknown words -> ``<unk>``), without start/end."""
        return [self.stoi.get(t, self.unk_id) for t in tokens]

    def encode_caption(self, tokens: Sequence[str]) -> list[int]:
        """``<start> w_1 .. w_k <end>`` as ids: the model's caption layout (ARCHITECTURE.md)."""
        return [self.start_id, *self.encode(tokens), self.end_id]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of ``ids``, stopping at ``<end>`` and dropping ``<start>``/``<pad>``."""
        return self.decode_positions(ids)[0]

    def decode_positions(self, ids: Iterable[int]) -> tuple[list[str], list[int]]:
        """Words of ``ids`` and their positions in ``ids`` (to pick each word's α row).

        Stops at ``<end>``; ``<start>``/``<pad>`` are dropped (an untrained model may emit them:
        they are not words).
        """
        words, positions = [], []
        for position, i in enumerate(ids):
            if i == END_ID:
                break
            if i in (PAD_ID, START_ID):
                continue
            if not 0 <= i < len(self.itos):
                raise VocabError(f"token id {i} outside vocabulary of size {len(self.itos)}")
            words.append(self.itos[i])
            positions.append(position)
        return words, positions

    def to_json(self) -> dict[str, object]:
        return {
            "format_version": FORMAT_VERSION,
            "itos": list(self.itos),
            "min_count": self.min_count,
            "max_size": self.max_size,
            "max_caption_length": self.max_caption_length,
        }


def build_vocab(
    token_lists: Iterable[Sequence[str]], min_count: int, max_size: int, max_caption_length: int
) -> Vocab:
    """Count words over ``token_lists`` (the training captions) and keep the frequent ones.

    A word is kept when it occurs at least ``min_count`` times; of those, the most frequent
    ``max_size - 4`` are kept (ties broken alphabetically, so the cut is deterministic).
    """
    if min_count < 1:
        raise VocabError(f"min_count must be >= 1, got {min_count}")
    if max_size <= len(SPECIALS):
        raise VocabError(f"max_size must exceed {len(SPECIALS)} (the specials), got {max_size}")
    counts = Counter(t for tokens in token_lists for t in tokens)
    for special in SPECIALS:
        counts.pop(special, None)  # a caption word "<unk>" cannot take a special's id
    ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    words = ranked[: max_size - len(SPECIALS)]
    return Vocab(SPECIALS + tuple(words), min_count, max_size, max_caption_length)


def save_vocab(vocab: Vocab, path: str | Path) -> None:
    """Write ``vocab.json`` atomically."""
    write_text_atomic(path, json.dumps(vocab.to_json(), ensure_ascii=False, indent=1) + "\n")


def load_vocab(path: str | Path) -> Vocab:
    """Read ``vocab.json``; raise :class:`VocabError` naming the file when it is not valid."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VocabError(f"cannot read vocabulary {path}: {e}") from e
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise VocabError(f"{path}: expected format_version {FORMAT_VERSION}")
    try:
        return Vocab(
            itos=tuple(data["itos"]),
            min_count=int(data["min_count"]),
            max_size=int(data["max_size"]),
            max_caption_length=int(data["max_caption_length"]),
        )
    except (KeyError, TypeError) as e:
        raise VocabError(f"{path}: missing or invalid field {e}") from e
