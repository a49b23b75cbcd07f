"""Attention overlays and the HTML gallery."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image

from sat_model.evaluation.visualize import (
    GalleryEntry,
    attention_map,
    overlay,
    write_gallery,
    write_word_overlays,
)
from sat_model.features.images import encoder_view


def _one_hot(index: int, size: int = 49) -> np.ndarray:
    alpha = np.zeros(size, dtype=np.float32)
    alpha[index] = 1.0
    return alpha


@pytest.mark.parametrize("index", [0, 10, 24, 48])
def test_map_peak_stays_in_the_attended_cell(index):
    heat = attention_map(_one_hot(index), 7, 7, (224, 224))
    assert heat.shape == (224, 224)
    row, col = divmod(index, 7)
    y, x = np.unravel_index(int(heat.argmax()), heat.shape)
    # cells are 32 px: the peak pixel must be in the attended cell
    assert row * 32 <= y < (row + 1) * 32
    assert col * 32 <= x < (col + 1) * 32


def test_map_is_scaled_to_unit_range_and_follows_non_square_sizes():
    alpha = np.random.default_rng(0).dirichlet(np.ones(12)).astype(np.float32)
    heat = attention_map(alpha, 3, 4, (200, 150))
    assert heat.shape == (150, 200)
    assert heat.min() == pytest.approx(0.0)
    assert heat.max() == pytest.approx(1.0)


def test_uniform_attention_gives_a_flat_map():
    heat = attention_map(np.full(49, 1 / 49, dtype=np.float32), 7, 7, (64, 64))
    assert np.all(heat == 0)


def test_map_rejects_alpha_of_the_wrong_length():
    with pytest.raises(ValueError, match="expected \\(49,\\)"):
        attention_map(np.ones(50), 7, 7, (224, 224))


def test_zero_heat_leaves_the_photo_unchanged():
    rng = np.random.default_rng(1)
    photo = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    out = overlay(photo, np.zeros((32, 48)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(photo))


def test_centre_crop_keeps_the_middle_of_a_landscape_photo():
    # left third red, middle third green, right third blue: the 30x30 centre crop of a 90x30
    # image resized to short side 30 (no change) is all green
    arr = np.zeros((30, 90, 3), dtype=np.uint8)
    arr[:, :30, 0] = arr[:, 30:60, 1] = arr[:, 60:, 2] = 255
    crop = np.asarray(encoder_view(Image.fromarray(arr), resize=30, crop=30))
    assert crop.shape == (30, 30, 3)
    assert (crop[..., 1] == 255).all() and (crop[..., 0] == 0).all()


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.captions: list[str] = []
        self._in_caption = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])
        self._in_caption = tag == "figcaption"

    def handle_data(self, data):
        if self._in_caption:
            self.captions.append(data)
            self._in_caption = False


def test_gallery_holds_a_map_for_every_word_of_every_caption(tmp_path):
    captions = {"img_a": ["a", "red", "circle"], "img/b": ["two", "blue", "squares", "<unk>"]}
    rng = np.random.default_rng(2)
    entries = []
    for image_id, words in captions.items():
        crop = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
        image_file = tmp_path / f"{len(entries)}.png"
        crop.save(image_file)
        alphas = rng.dirichlet(np.ones(16), size=len(words)).astype(np.float32)
        files = write_word_overlays(
            crop, words, alphas, grid_h=4, grid_w=4, out_dir=tmp_path, stem=image_id
        )
        entries.append(
            GalleryEntry(image_id, " ".join(words), image_file, tuple(words), tuple(files))
        )
    index = write_gallery(entries, tmp_path, title="soft attention")

    pngs = sorted(p.name for p in tmp_path.glob("*.png") if not re.fullmatch(r"\d\.png", p.name))
    assert len(pngs) == 3 + 4
    parser = _Collector()
    parser.feed(index.read_text())
    # two photos plus one map per word, each map file linked and existing, each word labelled
    assert len(parser.srcs) == 2 + 7
    assert all((tmp_path / src).is_file() for src in parser.srcs)
    assert parser.captions == ["image", *captions["img_a"], "image", *captions["img/b"]]


def test_word_and_map_counts_must_agree(tmp_path):
    photo = Image.new("RGB", (16, 16))
    with pytest.raises(ValueError, match="2 words but 1"):
        write_word_overlays(
            photo, ["a", "b"], np.ones((1, 4)) / 4, grid_h=2, grid_w=2, out_dir=tmp_path, stem="x"
        )
