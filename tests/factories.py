"""Tiny artefacts the tests share: the repository's root, a model config, a decoder and a batch
at toy sizes, a saved model folder, a hand-made ``captions.parquet``, a real photo of the
Flickr8k sample that is not square, and image files that declare a huge size (bombs).

Plain functions (``from tests.factories import ...``) rather than fixtures: module-scoped
fixtures and helpers that build whole projects call them too.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from sat_model.config import ModelParams
from sat_model.data.vocab import END_ID, PAD_ID, SPECIALS, START_ID, Vocab
from sat_model.features.encoders import build_encoder
from sat_model.model.checkpoint import save_checkpoint
from sat_model.model.config import ModelConfig
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.factory import build_model
from sat_model.model.kernels import build_backend
from sat_model.paths import shared_data

__all__ = [
    "ROOT",
    "TINY_D",
    "TINY_K",
    "TINY_L",
    "bmp_bomb",
    "copy_project",
    "gif_bomb",
    "jpeg_bomb",
    "model_config",
    "photo_of_another_shape",
    "png_bomb",
    "ppm_bomb",
    "registered_project",
    "sample_photos",
    "tiff_bomb",
    "tiny_batch",
    "tiny_model",
    "to_format_1",
    "webp_bomb",
    "write_captions",
    "write_references",
    "write_tiny_model",
    "write_trained_tiny_model",
]


def photo_of_another_shape() -> Path:
    """The first photo (by name) of the Flickr8k sample that is not square: a JPEG of 90-160 KB
    at its original size, mostly 500×375 (the test skips when the sample is absent)."""
    root = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
    if not root.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({root})")
    for path in sorted(root.glob("*.jpg")):
        with Image.open(path) as image:
            if image.width != image.height:
                return path
    pytest.skip(f"no photo of {root} is other than square")


ROOT = Path(__file__).resolve().parents[1]


def copy_project(dest: Path) -> Path:
    """This working tree's files (tracked and new, not ignored) in a fresh git repository."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "project"], cwd=dest, check=True)
    return dest


def model_config(
    *, vocab_size: int, annotation_dim: int, num_locations: int, **changes: Any
) -> ModelConfig:
    """A small ``ModelConfig`` (m = 8, n = 12, A = 8, no dropout, β gate on, soft attention)
    over the given K, D and L; ``changes`` set any other field."""
    values: dict[str, Any] = {
        "embed_dim": 8,
        "hidden_dim": 12,
        "attention_dim": 8,
        "dropout": 0.0,
        "gate": True,
        "attention": "soft",
    }
    return ModelConfig(
        vocab_size=vocab_size,
        annotation_dim=annotation_dim,
        num_locations=num_locations,
        **{**values, **changes},
    )


def write_tiny_model(
    directory: Path,
    *,
    words: Sequence[str] = ("a", "red", "circle"),
    crop: int = 64,
    resize: int | None = None,
    keep_aspect: bool | None = None,
    attention: str = "soft",
    seed: int = 0,
    real_words_only: bool = True,
    encoder_section: Mapping[str, Any] | None = None,
    data_source: str | None = None,
) -> Path:
    """A tiny model over the seeded ``random`` encoder (``crop`` px, 16 px cells, D = 32).

    ``real_words_only``: the output bias rules out every special token, so each caption is
    ``max_length`` real words. ``config.json`` records the encoder (resize default
    ``crop * 9 / 8``; ``keep_aspect`` only when given) or ``encoder_section`` as given, and
    ``data_source`` (``data.source``, as the train stage records it) only when given.
    """
    torch.manual_seed(seed)
    vocab = Vocab((*SPECIALS, *words), 1, 100, 20)
    d = build_encoder("random", input_size=crop).spec
    model = build_model(
        ModelParams(embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0),
        vocab_size=len(vocab),
        annotation_dim=d.annotation_dim,
        num_locations=d.num_locations,
        attention=attention,
    )
    if real_words_only:
        with torch.no_grad():
            model.out.bias[: len(SPECIALS)] = -1e4
    section = encoder_section or {**d.to_fields(), "resize": resize or crop * 9 // 8}
    if keep_aspect is not None:
        section = {**section, "keep_aspect": keep_aspect}
    save_checkpoint(
        directory,
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        extra_config={
            "attention": attention,
            "encoder": dict(section),
            **({"data": {"source": data_source}} if data_source else {}),
        },
    )
    return Path(directory)


REGISTERED_PARAMS = (
    "encoder: {name: random, resize: 72, crop: 64}\neval: {beam_size: 2, max_length: 4}\n"
)


def registered_project(root: Path) -> Path:
    """A new project folder ``root`` as ``make run`` leaves it for ``sat caption`` and ``sat
    serve``: ``params.yaml``, the SQLite store ``mlflow.db`` and ``mlartifacts/`` holding a
    tiny soft model (:func:`write_tiny_model`, words "a dog runs") registered and promoted
    ``champion`` the way the register stage does it."""
    from pipeline.settings import load_params
    from pipeline.tracking.packaging import log_and_register
    from pipeline.tracking.registry import promote_if_better
    from pipeline.tracking.runs import connect

    root.mkdir()
    (root / "params.yaml").write_text(REGISTERED_PARAMS)
    cfg = load_params(root / "params.yaml").mlflow
    tracking = connect(cfg, root)
    model_dir = write_tiny_model(root / "models" / "soft", words=("a", "dog", "runs"), resize=72)
    version = log_and_register(
        tracking.client(),
        model_dir=model_dir,
        model_name=cfg.model_name,
        experiment_id=tracking.experiment_id,
        metrics={"bleu_4": 0.1},
        params={},
        tags={"sat.attention": "soft"},
        decoding={"beam_size": 2, "max_length": 4},
    )
    promote_if_better(tracking.client(), cfg.model_name, version.version, "bleu_4")
    return root


def to_format_1(directory: Path) -> Path:
    """Rewrite a model folder as sat wrote it before safetensors (format 1): one ``model.pt``, a
    ``torch.save`` of the weights, the training state, the config and the vocabulary, beside
    ``config.json`` and ``vocab.json``."""
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        metadata = f.metadata()
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (no __iter__)
    training = torch.load(directory / "best_state.pt", weights_only=True)
    config = {**json.loads(metadata["config"]), "format_version": 1}
    kept = ("train_state", "criterion_state", "optimizer_state", "scheduler_state")
    payload = {
        "format_version": 1,
        "model_state": weights,
        **{key: training[key] for key in (*kept, "epoch", "best_score", "best_epoch")},
        "config": config,
        "itos": json.loads(metadata["itos"]),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    torch.save(payload, directory / "model.pt")
    (directory / "model.safetensors").unlink()
    (directory / "best_state.pt").unlink()
    return directory


def write_captions(path: Path, rows: Iterable[tuple[str, str, int, str]]) -> Path:
    """A ``captions.parquet`` of ``(image_id, split, caption_index, raw)`` rows (split tokens)."""
    rows = list(rows)
    table = pa.table(
        {
            "image_id": [r[0] for r in rows],
            "split": [r[1] for r in rows],
            "file": [f"{r[0]}.png" for r in rows],
            "caption_index": pa.array([r[2] for r in rows], pa.int32()),
            "raw": [r[3] for r in rows],
            "tokens": [r[3].split() for r in rows],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def write_references(
    path: Path, references: Mapping[str, Sequence[str]], split: str = "test"
) -> Path:
    """A ``captions.parquet`` of ``references`` (image id -> raw captions) in one split."""
    rows = [(i, split, k, r) for i, captions in references.items() for k, r in enumerate(captions)]
    return write_captions(path, rows)


# a small file of each format that declares a huge image; each *_bomb below patches its header
def _saved(fmt: str, **options: Any) -> bytearray:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (220, 40, 40)).save(buffer, format=fmt, **options)
    return bytearray(buffer.getvalue())


def png_bomb(w: int, h: int) -> bytes:
    d = _saved("PNG")
    struct.pack_into(">II", d, 16, w, h)  # IHDR width, height
    struct.pack_into(">I", d, 29, zlib.crc32(bytes(d[12:29])))  # IHDR CRC
    return bytes(d)


def jpeg_bomb(w: int, h: int) -> bytes:
    d = _saved("JPEG")
    sof = d.index(b"\xff\xc0")  # SOF0: marker, length, precision, height, width
    struct.pack_into(">HH", d, sof + 5, h, w)
    return bytes(d)


def webp_bomb(w: int, h: int) -> bytes:
    d = _saved("WEBP", lossless=True)
    at = d.index(b"VP8L") + 9  # after the chunk header and the 0x2f signature: 14+14 bits
    bits = struct.unpack_from("<I", d, at)[0] & ~((1 << 28) - 1)
    struct.pack_into("<I", d, at, bits | (w - 1) | ((h - 1) << 14))
    return bytes(d)


def bmp_bomb(w: int, h: int) -> bytes:
    d = _saved("BMP")
    struct.pack_into("<ii", d, 18, w, h)  # BITMAPINFOHEADER width, height
    return bytes(d)


def gif_bomb(w: int, h: int) -> bytes:
    d = _saved("GIF")
    struct.pack_into("<HH", d, 6, w, h)  # logical screen
    return bytes(d)


def tiff_bomb(w: int, h: int) -> bytes:
    d = _saved("TIFF")
    (ifd,) = struct.unpack_from("<I", d, 4)
    (count,) = struct.unpack_from("<H", d, ifd)
    for k in range(count):  # ImageWidth (256) and ImageLength (257) entries
        tag, kind = struct.unpack_from("<HH", d, ifd + 2 + 12 * k)
        if tag in (256, 257):
            fmt = "<H" if kind == 3 else "<I"
            struct.pack_into(fmt, d, ifd + 2 + 12 * k + 8, w if tag == 256 else h)
    return bytes(d)


def ppm_bomb(w: int, h: int) -> bytes:
    return f"P6\n{w} {h}\n255\n".encode() + b"\0" * 12


# the decoder at toy sizes: K words, D-dimensional annotations at L locations
TINY_K, TINY_D, TINY_L = 12, 8, 6


def tiny_model(
    attention: str = "soft", backend: str = "native", **overrides: object
) -> ShowAttendTell:
    fields: dict[str, Any] = dict(
        vocab_size=TINY_K,
        annotation_dim=TINY_D,
        num_locations=TINY_L,
        hidden_dim=16,
        attention=attention,
    )
    fields.update(overrides)
    config = model_config(**fields)
    return ShowAttendTell(config, build_backend(backend))


def tiny_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """4 images (B, L, D) and their captions (B, T+1) of different lengths, padded."""
    g = torch.Generator().manual_seed(seed)
    annotations = torch.randn(4, TINY_L, TINY_D, generator=g)
    captions = torch.tensor(
        [
            [START_ID, 4, 5, 6, END_ID, PAD_ID, PAD_ID],
            [START_ID, 7, 8, END_ID, PAD_ID, PAD_ID, PAD_ID],
            [START_ID, 9, 10, 11, 4, 5, END_ID],
            [START_ID, 6, END_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],
        ]
    )
    return annotations, captions


def sample_photos(count: int) -> list[Path]:
    """The first ``count`` photos (by name) of the Flickr8k sample (skips when it is absent)."""
    root = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
    photos = sorted(root.glob("*.jpg"))[:count]
    if len(photos) < count:
        pytest.skip(f"the Flickr8k sample is absent or short ({root})")
    return photos


def _first_captions(photos: Sequence[Path]) -> list[list[str]]:
    """Each photo's first Flickr8k caption (by file name), tokenised."""
    from sat_model.data.text import tokenize

    token_file = shared_data("flickr8k-sample") / "Flickr8k_text" / "Flickr8k.token.txt"
    first: dict[str, str] = {}
    for line in token_file.read_text(encoding="utf-8").splitlines():
        key, _, text = line.partition("\t")
        first.setdefault(key.split("#")[0], text)
    return [tokenize(first[p.name]) for p in photos]


def write_trained_tiny_model(
    directory: Path,
    photos: Sequence[Path],
    *,
    crop: int = 64,
    resize: int = 72,
    steps: int = 150,
    encoder: str = "random",
) -> Path:
    """A tiny soft model over ``encoder`` (the seeded ``random`` one by default), trained
    (teacher forcing, Adam) on ``photos`` with their first Flickr8k captions, from features cut
    as the extract stage cuts them. Its captions differ from photo to photo, so a change in
    pixels can change them (an untrained model says the same words of every photo)."""
    from sat_model.data.vocab import build_vocab
    from sat_model.features.images import Preprocessing
    from sat_model.model.losses import SoftAttentionLoss

    torch.manual_seed(0)
    trunk = build_encoder(encoder, input_size=crop)
    prep = Preprocessing(resize, crop)
    annotations = trunk.annotate(torch.stack([prep.pixels(p) for p in photos])).float()
    tokens = _first_captions(photos)
    vocab = build_vocab(tokens, 1, 1000, 20)
    encoded = [vocab.encode_caption(t) for t in tokens]
    width = max(map(len, encoded))
    captions = torch.tensor([c + [0] * (width - len(c)) for c in encoded])  # (B, T+1), <pad> = 0
    model = build_model(
        ModelParams(embed_dim=32, hidden_dim=64, attention_dim=32, dropout=0.0),
        vocab_size=len(vocab),
        annotation_dim=trunk.spec.annotation_dim,
        num_locations=trunk.spec.num_locations,
        attention="soft",
    )
    criterion, optimizer = SoftAttentionLoss(1.0), torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        criterion(model(annotations, captions), captions).loss.backward()
        optimizer.step()
    section = {**trunk.spec.to_fields(), "resize": resize}
    save_checkpoint(
        directory,
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        extra_config={"attention": "soft", "encoder": section},
    )
    return Path(directory)
