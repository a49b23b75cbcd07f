"""A malformed or hostile checkpoint is a CheckpointError, raised before anything is sized."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sat_model.data.vocab import build_vocab
from sat_model.model.checkpoint import (
    MODEL_FILE,
    CheckpointError,
    load_checkpoint,
    load_model,
    save_checkpoint,
    weights_sha256,
)
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from tests.factories import model_config, to_format_1

WORDS = ["a", "red", "circle", "square"]


def _config(vocab_size: int, **changes: object) -> ModelConfig:
    return model_config(
        vocab_size=vocab_size, annotation_dim=5, num_locations=6, attention_dim=7, **changes
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    vocab = build_vocab([WORDS], 1, 100, 20)
    config = _config(len(vocab))
    save_checkpoint(
        tmp_path / "ckpt",
        model_config=config,
        vocab=vocab,
        model_state=ShowAttendTell(config).state_dict(),
    )
    return tmp_path / "ckpt"


def _rewrite(directory: Path, edit) -> None:
    """Edit what the folder holds (and ``config.json`` to agree), as a forger would: one
    payload of format 1's ``model.pt``, or the weights, metadata and ``best_state.pt`` of
    format 2 rewritten with a matching ``weights_sha256``."""
    if (directory / "model.pt").is_file():
        payload = torch.load(directory / "model.pt", weights_only=True)
        edit(payload)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        (directory / "model.pt").write_bytes(buffer.getvalue())
    else:
        payload = _format_2_payload(directory)
        edit(payload)
        _write_format_2(directory, payload)
    if isinstance(payload.get("config"), dict):
        (directory / "config.json").write_text(json.dumps(payload["config"], indent=1) + "\n")


def _format_2_payload(directory: Path) -> dict:
    with safe_open(directory / MODEL_FILE, framework="pt") as f:
        metadata = f.metadata()
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (no __iter__)
    sections = {key: json.loads(metadata[key]) for key in ("config", "itos")}
    best = torch.load(directory / "best_state.pt", weights_only=True)
    return {**best, **sections, "model_state": weights}


def _write_format_2(directory: Path, payload: dict) -> None:
    weights = payload.pop("model_state")
    digest = weights_sha256(weights)
    metadata = {"format_version": "2", "weights_sha256": digest}
    metadata |= {key: json.dumps(payload.pop(key)) for key in ("config", "itos") if key in payload}
    save_file(weights, directory / MODEL_FILE, metadata=metadata)
    torch.save({**payload, "weights_sha256": digest}, directory / "best_state.pt")


def _set_model_field(key: str, value: object):
    def edit(payload: dict) -> None:
        payload["config"]["model"][key] = value

    return edit


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hidden_dim", 30000, "does not fit the saved model config"),  # weights are for 12
        ("hidden_dim", 10**12, r"hidden_dim=1000000000000 must be in \[1, 65536\]"),
        ("embed_dim", -8, r"embed_dim=-8 must be in \[1, 65536\]"),
        ("hidden_dim", "12", "hidden_dim='12' must be a number, not str"),
        ("hidden_dim", 12.5, "must be an integer"),
        ("hidden_dim", True, "must be a number, not bool"),
        ("gate", 1, "must be true or false"),
        ("attention", "sparse", "unknown attention 'sparse'"),
        ("dropout", float("nan"), "must be finite"),
        ("num_locations", None, "must be a number, not NoneType"),
    ],
)
def test_a_hostile_model_config_is_refused_before_the_model_is_built(
    checkpoint: Path, key: str, value: object, message: str
) -> None:
    _rewrite(checkpoint, _set_model_field(key, value))
    with pytest.raises(CheckpointError, match=message):
        load_model(checkpoint)


@pytest.mark.parametrize("weights", ["model.safetensors", "model.pt"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.pop("config"), "no 'config'"),
        (lambda p: p.update(config=[1, 2]), "config is list, expected dict"),
        (lambda p: p["config"].pop("model"), "model config is NoneType"),
        (lambda p: p["config"]["model"].pop("hidden_dim"), r"missing keys \['hidden_dim'\]"),
        (lambda p: p["config"]["model"].update(heads=4), r"unknown keys \['heads'\]"),
        (lambda p: p.update(itos="a b c"), "itos is str, expected list"),
        (lambda p: p.update(epoch="3"), "epoch is str, expected int"),
        (lambda p: p.update(epoch=True), "epoch is bool, expected int"),
        (lambda p: p["model_state"].pop("embedding.weight"), r"missing \['embedding.weight'\]"),
        (lambda p: p["model_state"].update(extra=torch.zeros(1)), r"unexpected \['extra'\]"),
        (
            lambda p: p.update(train_state={"embedding.weight": torch.zeros(2, 2)}),
            "train_state does not fit",
        ),
    ],
)
def test_a_malformed_payload_is_a_checkpoint_error(
    checkpoint: Path, edit, message: str, weights: str
) -> None:
    if weights == "model.pt":
        to_format_1(checkpoint)
    _rewrite(checkpoint, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(checkpoint, training=True)


def test_format_1_weights_that_are_not_tensors_are_refused(checkpoint: Path) -> None:
    _rewrite(to_format_1(checkpoint), lambda p: p.update(model_state={"w": [1.0]}))
    with pytest.raises(CheckpointError, match="not a mapping of names to tensors"):
        load_checkpoint(checkpoint)


def test_weights_without_sat_metadata_are_refused(checkpoint: Path) -> None:
    save_file(ShowAttendTell(_config(6)).state_dict(), checkpoint / MODEL_FILE)
    with pytest.raises(CheckpointError, match="is not a sat checkpoint: no 'format_version'"):
        load_model(checkpoint)


def test_a_truncated_model_file_is_a_checkpoint_error(checkpoint: Path) -> None:
    data = (checkpoint / MODEL_FILE).read_bytes()
    (checkpoint / MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted"):
        load_model(checkpoint)


def test_bad_json_beside_the_weights_is_a_checkpoint_error(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(checkpoint)


def test_the_intact_checkpoint_still_loads(checkpoint: Path) -> None:
    model, vocab, config = load_model(checkpoint)
    assert config.hidden_dim == 12 and len(vocab) == config.vocab_size
    assert not model.training


_PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from sat_model.model.checkpoint import CheckpointError, load_model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        load_model(sys.argv[1])
    except CheckpointError as e:
        print("refused:", e, file=sys.stderr)
    else:
        sys.exit("loaded a checkpoint whose weights do not fit its config")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)  # ru_maxrss is in KiB on Linux
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units differ off Linux")
def test_a_huge_hidden_dim_fails_without_a_large_allocation(checkpoint: Path) -> None:
    # hidden_dim 30000 beside weights for 12: building that model would allocate the 4n x n LSTM
    # matrix alone, 14.4 GB; the peak RSS of a fresh interpreter must barely move while refusing
    _rewrite(checkpoint, _set_model_field("hidden_dim", 30000))
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "does not fit the saved model config" in done.stderr
    assert int(done.stdout) < 64 * 2**20, f"peak RSS grew by {int(done.stdout) / 2**20:.0f} MiB"


def _flip_a_weight_byte(path: Path) -> None:
    """Flip one byte inside the largest stored tensor of a torch zip archive, CRC unchanged."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_weight_byte_is_refused_in_the_model_and_the_training_state(
    tmp_path: Path,
) -> None:
    # torch.load reads a stored member without checking its CRC: the flip would load silently
    from sat_model.model.checkpoint import CheckpointError, check_archive
    from sat_model.train.run import load_training_state, save_training_state

    state = tmp_path / "last_state.pt"
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    save_training_state(
        state, {"model_state": weights, "optimizer_state": {}, "epoch": 1, "phase": "likelihood"}
    )
    assert torch.equal(load_training_state(state)["model_state"]["w"], weights["w"])
    _flip_a_weight_byte(state)
    assert not torch.equal(
        torch.load(state, weights_only=True)["model_state"]["w"], weights["w"]
    )  # torch alone takes the flipped weight
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_training_state(state)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        check_archive(state)
