"""Checkpoints rebuild the model from their files alone and refuse anything suspicious."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from sat_model.data.vocab import build_vocab
from sat_model.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model,
    save_checkpoint,
    state_of,
)
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.decoding import greedy
from sat_model.model.losses import HardAttentionLoss
from tests.factories import model_config

WORDS = ["a", "red", "blue", "circle", "square", "left", "of", "the"]
L, D = 6, 5


def _vocab(words=WORDS):
    return build_vocab([words], 1, 100, 20)


def _config(vocab_size: int, attention: str = "soft") -> ModelConfig:
    return model_config(
        vocab_size=vocab_size,
        annotation_dim=D,
        num_locations=L,
        attention_dim=7,
        dropout=0.3,
        attention=attention,
    )


def _trained_state(tmp_path: Path, attention: str = "soft"):
    torch.manual_seed(0)
    vocab = _vocab()
    model = ShowAttendTell(_config(len(vocab), attention))
    criterion = HardAttentionLoss(0.1, 0.002, 0.9)
    criterion.baseline.fill_(-1.25)  # a non-default baseline must survive the round trip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    captions = torch.tensor([[1, 4, 5, 2], [1, 6, 7, 2]])
    annotations = torch.randn(2, L, D)
    out = model(annotations, captions)
    nn.functional.cross_entropy(
        out.logits.reshape(-1, len(vocab)), captions[:, 1:].reshape(-1)
    ).backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / "ckpt",
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        criterion_state=criterion.state_dict(),
        optimizer_state=optimizer.state_dict(),
        epoch=3,
        best_score=0.25,
        best_epoch=2,
        extra_config={"encoder": {"name": "random"}},
    )
    return path, model, vocab, criterion


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_save_then_load_gives_identical_logits_and_greedy_captions(
    tmp_path: Path, attention: str
) -> None:
    path, model, vocab, _ = _trained_state(tmp_path, attention)
    loaded, loaded_vocab, config = load_model(path)
    assert config == model.config
    assert loaded_vocab.itos == vocab.itos
    assert not loaded.training
    model.eval()
    annotations = torch.randn(3, L, D)
    captions = torch.tensor([[1, 4, 5, 2, 0], [1, 6, 7, 8, 2], [1, 9, 2, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(annotations, captions).logits,
            model(annotations, captions).logits,
            rtol=0,
            atol=0,
        )
    a = greedy(model, annotations, max_length=6)
    b = greedy(loaded, annotations, max_length=6)
    assert [c.tokens for c in a] == [c.tokens for c in b]


def test_checkpoint_keeps_criterion_baseline_optimizer_and_scores(tmp_path: Path) -> None:
    path, _, _, criterion = _trained_state(tmp_path)
    ckpt = load_checkpoint(path)
    assert ckpt.criterion_state["baseline"].item() == pytest.approx(-1.25)
    restored = HardAttentionLoss(0.1, 0.002, 0.9)
    restored.load_state_dict(ckpt.criterion_state)
    assert restored.baseline.item() == criterion.baseline.item()
    assert ckpt.optimizer_state is not None and ckpt.optimizer_state["state"]
    assert (ckpt.epoch, ckpt.best_score, ckpt.best_epoch) == (3, 0.25, 2)
    assert ckpt.config["encoder"] == {"name": "random"}
    assert json.loads((path / "config.json").read_text())["model"]["vocab_size"] == len(ckpt.vocab)


def test_train_state_travels_beside_the_moving_average_and_is_optional(tmp_path: Path) -> None:
    path, model, vocab, _ = _trained_state(tmp_path)
    assert load_checkpoint(path).train_state is None  # saved without one
    trained = {k: v + 1.0 for k, v in model.state_dict().items()}
    save_checkpoint(
        tmp_path / "ema",
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        train_state=trained,
    )
    ckpt = load_checkpoint(tmp_path / "ema")
    for name, value in trained.items():
        assert torch.equal(ckpt.train_state[name], value), name
    # the model that is loaded for use is model_state, the average
    loaded, _, _ = load_model(tmp_path / "ema")
    assert torch.equal(loaded.out.weight, model.out.weight)


def test_vocab_of_another_size_is_refused(tmp_path: Path) -> None:
    path, *_ = _trained_state(tmp_path)
    other = _vocab([*WORDS, "green"])
    with pytest.raises(CheckpointError, match="another vocabulary: 12 words in the checkpoint, 13"):
        load_checkpoint(path, vocab=other)


def test_vocab_json_swapped_for_another_is_refused(tmp_path: Path) -> None:
    path, *_ = _trained_state(tmp_path)
    from sat_model.data.vocab import save_vocab

    save_vocab(_vocab([*WORDS, "green", "big"]), path / "vocab.json")
    with pytest.raises(CheckpointError, match="is not the vocabulary"):
        load_model(path)


def test_model_config_disagreeing_with_vocab_is_refused_at_save(tmp_path: Path) -> None:
    vocab = _vocab()
    model = ShowAttendTell(_config(len(vocab) + 1))
    with pytest.raises(CheckpointError, match="vocab_size 13 != vocabulary size 12"):
        save_checkpoint(
            tmp_path, model_config=model.config, vocab=vocab, model_state=model.state_dict()
        )


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_weight"])
def test_corrupted_model_file_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    path, *_ = _trained_state(tmp_path)
    data = bytearray((path / "model.pt").read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"not a checkpoint" * 64)
    else:  # one byte inside the largest tensor's storage: torch.load alone would not notice
        with zipfile.ZipFile(path / "model.pt") as archive:
            info = max(archive.infolist(), key=lambda i: i.file_size)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + info.file_size // 2] ^= 0x01
    (path / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_model(path)


class _Payload:
    """A custom class: unpickling it would run code from the file."""


@pytest.mark.parametrize("payload", [lambda: _Payload(), lambda: nn.Linear(2, 2)])
def test_checkpoint_carrying_pickled_code_is_refused(tmp_path: Path, payload) -> None:
    path, *_ = _trained_state(tmp_path)
    torch.save({"format_version": 1, "model_state": payload()}, path / "model.pt")
    with pytest.raises(CheckpointError, match="refusing to unpickle code"):
        load_checkpoint(path)


def test_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


def test_state_of_is_a_detached_copy() -> None:
    layer = nn.Linear(2, 2)
    copy = state_of(layer)
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert not torch.equal(copy["weight"], layer.weight)
