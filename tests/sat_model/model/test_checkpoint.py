"""Checkpoints rebuild the model from their files alone and refuse anything suspicious."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from sat_model.data.vocab import build_vocab
from sat_model.model import checkpoint
from sat_model.model.checkpoint import (
    CheckpointError,
    TrainingState,
    is_checkpoint_dir,
    load_checkpoint,
    load_model,
    model_files,
    save_checkpoint,
    state_of,
)
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.decoding import greedy
from sat_model.model.losses import HardAttentionLoss
from tests.factories import model_config, to_format_1

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
        training=TrainingState(
            criterion.state_dict(), optimizer.state_dict(), epoch=3, best_score=0.25, best_epoch=2
        ),
        extra_config={"encoder": {"name": "random"}},
    )
    return path, model, vocab, criterion


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_save_then_load_gives_identical_logits_and_greedy_captions(
    tmp_path: Path, attention: str
) -> None:
    path, model, vocab, _ = _trained_state(tmp_path, attention)
    loaded, loaded_vocab, config = load_model(path, backend="readable")  # as `model` was built
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


def test_the_weights_load_with_safetensors_alone_bit_for_bit(tmp_path: Path) -> None:
    path, model, _, _ = _trained_state(tmp_path)
    weights = safetensors.torch.load_file(path / "model.safetensors")
    for name, value in model.state_dict().items():
        assert weights[name].dtype == value.dtype and torch.equal(weights[name], value), name
    config = json.loads((path / "config.json").read_text())
    rebuilt = ShowAttendTell(ModelConfig(**config["model"]))
    rebuilt.load_state_dict(weights)  # strict: every name, every shape
    assert sorted(p.name for p in path.iterdir()) == [
        "best_state.pt",
        "config.json",
        "model.safetensors",
        "vocab.json",
    ]


def test_loading_a_model_for_use_unpickles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model, _, _ = _trained_state(tmp_path)

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load called to load a model for use")

    monkeypatch.setattr(torch, "load", no_pickle)
    loaded, _, _ = load_model(path)
    assert torch.equal(loaded.out.weight, model.out.weight)
    assert load_checkpoint(path).training is None  # what resuming needs is read only on request


def test_loading_a_model_leaves_pytorchs_compiler_unimported(tmp_path: Path) -> None:
    """The shape check builds the model on the meta device, where ``normal_`` and ``stack``
    run Python decompositions whose first call imports ``torch._dynamo`` (and sympy): a cost in
    every process that loads a model, a served replica's or a caption's."""
    vocab = _vocab()
    config = model_config(
        vocab_size=len(vocab), annotation_dim=D, num_locations=L, attention_dim=7,
        attention="hard", coordinates=True, grid_w=3, normalize_features=True,
    )  # fmt: skip
    save_checkpoint(
        tmp_path / "ckpt",
        model_config=config,
        vocab=vocab,
        model_state=ShowAttendTell(config).state_dict(),
    )
    script = (
        "import sys\nfrom sat_model.model.checkpoint import load_model\n"
        "model, _, _ = load_model(sys.argv[1])\nassert model.coords.shape == (6, 2)\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_checkpoint_keeps_criterion_baseline_optimizer_and_scores(tmp_path: Path) -> None:
    path, _, _, criterion = _trained_state(tmp_path)
    ckpt = load_checkpoint(path, training=True)
    saved = ckpt.training
    assert saved is not None
    assert saved.criterion_state["baseline"].item() == pytest.approx(-1.25)
    restored = HardAttentionLoss(0.1, 0.002, 0.9)
    restored.load_state_dict(saved.criterion_state)
    assert restored.baseline.item() == criterion.baseline.item()
    assert saved.optimizer_state is not None and saved.optimizer_state["state"]
    assert (saved.epoch, saved.best_score, saved.best_epoch) == (3, 0.25, 2)
    assert ckpt.config["encoder"] == {"name": "random"}
    assert json.loads((path / "config.json").read_text())["model"]["vocab_size"] == len(ckpt.vocab)


def test_train_state_travels_beside_the_moving_average_and_is_optional(tmp_path: Path) -> None:
    path, model, vocab, _ = _trained_state(tmp_path)
    assert load_checkpoint(path, training=True).training.train_state is None  # saved without one
    trained = {k: v + 1.0 for k, v in model.state_dict().items()}
    save_checkpoint(
        tmp_path / "ema",
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        training=TrainingState(train_state=trained),
    )
    ckpt = load_checkpoint(tmp_path / "ema", training=True)
    for name, value in trained.items():
        assert torch.equal(ckpt.training.train_state[name], value), name
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


def _flip_a_weight_byte(path: Path) -> None:
    """Flip one bit in the middle of the stored tensors: of a safetensors file (after its
    8-byte header length and JSON header) or of the largest member of a torch zip archive."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        start = 8 + int.from_bytes(data[:8], "little")
        data[start + (len(data) - start) // 2] ^= 0x01
    else:
        with zipfile.ZipFile(path) as archive:
            info = max(archive.infolist(), key=lambda i: i.file_size)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("weights", ["model.safetensors", "model.pt"])
@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_weight"])
def test_corrupted_model_file_is_a_clear_error(tmp_path: Path, damage: str, weights: str) -> None:
    path, *_ = _trained_state(tmp_path)
    if weights == "model.pt":
        to_format_1(path)
    if damage == "flip_weight":  # safetensors and torch.load alone would load another weight
        _flip_a_weight_byte(path / weights)
    else:
        data = (path / weights).read_bytes()
        bad = data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint" * 64
        (path / weights).write_bytes(bad)
    with pytest.raises(CheckpointError, match="corrupted"):
        load_model(path)


def test_a_flipped_byte_in_the_training_state_is_refused_on_resume(tmp_path: Path) -> None:
    path, *_ = _trained_state(tmp_path)
    _flip_a_weight_byte(path / "best_state.pt")
    load_model(path)  # using the model does not read it
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path, training=True)


def _save_crashing_before(name: str, monkeypatch: pytest.MonkeyPatch, path: Path, **changes):
    """Save another checkpoint into ``path`` and crash just before ``name`` is written."""
    vocab = _vocab()
    model = ShowAttendTell(_config(len(vocab)))
    real = checkpoint.write_bytes_atomic

    def crash(target: Path, data: bytes) -> None:
        if target.name == name:
            raise KeyboardInterrupt("killed")
        real(target, data)

    monkeypatch.setattr(checkpoint, "write_bytes_atomic", crash)
    monkeypatch.setattr(checkpoint, "write_text_atomic", lambda t, d: crash(t, d.encode()))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(
            path, model_config=model.config, vocab=vocab, model_state=model.state_dict(), **changes
        )
    monkeypatch.undo()


def test_a_crash_before_the_weights_are_written_leaves_a_folder_that_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model, *_ = _trained_state(tmp_path)
    # the training state of the new epoch beside the old weights: not a state to resume from
    _save_crashing_before("config.json", monkeypatch, path, training=TrainingState(epoch=4))
    with pytest.raises(CheckpointError, match=r"belongs to other weights than model\.safetensors"):
        load_checkpoint(path, training=True)
    loaded, _, _ = load_model(path)  # the old weights and their config still agree: usable
    assert torch.equal(loaded.out.weight, model.out.weight)
    # a new config.json beside the old weights: refused, for use and to resume
    _save_crashing_before("model.safetensors", monkeypatch, path, extra_config={"encoder": {}})
    with pytest.raises(CheckpointError, match=r"config\.json does not match model\.safetensors"):
        load_model(path)


def test_a_format_1_folder_still_loads_for_use_and_to_resume(tmp_path: Path) -> None:
    path, model, vocab, criterion = _trained_state(tmp_path)
    to_format_1(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.pt", "vocab.json"]
    assert is_checkpoint_dir(path) and model_files(path)[0] == "model.pt"
    loaded, loaded_vocab, config = load_model(path)
    assert config == model.config and loaded_vocab.itos == vocab.itos
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ckpt = load_checkpoint(path, training=True)
    assert ckpt.format_version == 1 and ckpt.training is not None
    assert ckpt.training.criterion_state["baseline"].item() == criterion.baseline.item()
    assert (ckpt.training.epoch, ckpt.training.best_score, ckpt.training.best_epoch) == (3, 0.25, 2)
    assert ckpt.training.optimizer_state is not None and ckpt.training.optimizer_state["state"]
    # the next save writes format 2 and drops the stale model.pt
    save_checkpoint(path, model_config=config, vocab=vocab, model_state=loaded.state_dict())
    assert not (path / "model.pt").exists() and model_files(path)[0] == "model.safetensors"


class _Payload:
    """A custom class: unpickling it would run code from the file."""


@pytest.mark.parametrize("file", ["best_state.pt", "model.pt"])
@pytest.mark.parametrize("payload", [lambda: _Payload(), lambda: nn.Linear(2, 2)])
def test_checkpoint_carrying_pickled_code_is_refused(tmp_path: Path, payload, file: str) -> None:
    path, *_ = _trained_state(tmp_path)
    if file == "model.pt":  # a format-1 folder
        to_format_1(path)
    torch.save({"format_version": 1, "model_state": payload()}, path / file)
    with pytest.raises(CheckpointError, match="refusing to unpickle code"):
        load_checkpoint(path, training=True)


def test_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


def test_state_of_is_a_detached_copy() -> None:
    layer = nn.Linear(2, 2)
    copy = state_of(layer)
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert not torch.equal(copy["weight"], layer.weight)
