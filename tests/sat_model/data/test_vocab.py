"""Vocabulary: stable ids, limits, encoding, and the vocab.json round trip."""

import json
from pathlib import Path

import pytest

from sat_model.data.vocab import SPECIALS, Vocab, VocabError, build_vocab, load_vocab, save_vocab

CAPTIONS = [
    ["a", "red", "circle"],
    ["a", "blue", "square"],
    ["a", "red", "square"],
    ["two", "circles"],
]
# counts by hand: a 3, red 2, square 2, blue 1, circle 1, circles 1, two 1


def test_build_vocab_puts_specials_first_then_words_by_count_then_alphabet() -> None:
    vocab = build_vocab(CAPTIONS, min_count=1, max_size=100, max_caption_length=20)
    assert vocab.itos == (*SPECIALS, "a", "red", "square", "blue", "circle", "circles", "two")
    assert (vocab.pad_id, vocab.start_id, vocab.end_id, vocab.unk_id) == (0, 1, 2, 3)
    assert vocab.itos[:4] == ("<pad>", "<start>", "<end>", "<unk>")


def test_build_vocab_drops_words_below_min_count() -> None:
    vocab = build_vocab(CAPTIONS, min_count=2, max_size=100, max_caption_length=20)
    assert vocab.itos[4:] == ("a", "red", "square")


def test_build_vocab_max_size_counts_specials() -> None:
    vocab = build_vocab(CAPTIONS, min_count=1, max_size=6, max_caption_length=20)
    assert len(vocab) == 6
    assert vocab.itos[4:] == ("a", "red")


def test_build_vocab_is_independent_of_caption_order() -> None:
    a = build_vocab(CAPTIONS, 1, 100, 20)
    b = build_vocab(list(reversed(CAPTIONS)), 1, 100, 20)
    assert a.itos == b.itos


def test_build_vocab_never_gives_a_caption_word_a_special_id() -> None:
    vocab = build_vocab([["<unk>", "<pad>", "x"]] * 3, 1, 100, 20)
    assert vocab.itos == (*SPECIALS, "x")


def test_encode_maps_unknown_words_to_unk_and_decode_stops_at_end() -> None:
    vocab = build_vocab(CAPTIONS, 1, 100, 20)
    ids = vocab.encode_caption(["a", "green", "circle"])
    assert ids == [1, vocab.stoi["a"], 3, vocab.stoi["circle"], 2]
    assert vocab.decode([*ids, 0, 0]) == ["a", "<unk>", "circle"]
    assert vocab.decode([vocab.stoi["red"], 2, vocab.stoi["a"]]) == ["red"]


def test_decode_rejects_an_id_outside_the_vocabulary() -> None:
    vocab = build_vocab(CAPTIONS, 1, 100, 20)
    with pytest.raises(VocabError, match="99"):
        vocab.decode([99])


def test_save_then_load_gives_the_same_vocab(tmp_path: Path) -> None:
    vocab = build_vocab(CAPTIONS, 1, 100, 17)
    save_vocab(vocab, tmp_path / "vocab.json")
    data = json.loads((tmp_path / "vocab.json").read_text())
    assert data == {
        "format_version": 1,
        "itos": list(vocab.itos),
        "min_count": 1,
        "max_size": 100,
        "max_caption_length": 17,
    }
    assert load_vocab(tmp_path / "vocab.json") == vocab
    assert [p.name for p in tmp_path.iterdir()] == ["vocab.json"]  # no temp file left


def test_vocab_rejects_a_list_without_specials_first() -> None:
    with pytest.raises(VocabError, match="must start with"):
        Vocab(("a", "<pad>", "<start>", "<end>", "<unk>"), 1, 10, 5)


def test_load_vocab_names_the_file_when_it_is_not_json(tmp_path: Path) -> None:
    bad = tmp_path / "vocab.json"
    bad.write_text("{not json")
    with pytest.raises(VocabError, match=r"vocab\.json"):
        load_vocab(bad)


def test_build_vocab_rejects_max_size_without_room_for_words() -> None:
    with pytest.raises(VocabError, match="max_size"):
        build_vocab(CAPTIONS, 1, 4, 20)
