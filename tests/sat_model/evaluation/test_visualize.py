"""Attention maps, the figure per caption (photo, then a panel per word) and its index page."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sat_model.evaluation.visualize import (
    Attended,
    AttentionFigures,
    attended_cells,
    attention_map,
    brighten,
    draw_attention_figure,
    panel_heats,
)
from sat_model.features.images import encoder_view
from tests.figures import figure_panels, read_index


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


def test_map_keeps_alpha_units_and_follows_non_square_sizes():
    alpha = np.random.default_rng(0).dirichlet(np.ones(12)).astype(np.float32)
    heat = attention_map(alpha, 3, 4, (200, 150))
    assert heat.shape == (150, 200)
    # upsampling and smoothing average α: the map stays within α's own range
    assert alpha.min() - 1e-6 <= heat.min() and heat.max() <= alpha.max() + 1e-6


def test_the_words_of_one_image_share_one_scale():
    # a peaked word and a near-uniform one: the second must not be stretched to look as sharp
    peaked = _one_hot(24)
    spread = np.full(49, 1 / 49, np.float32) + np.random.default_rng(0).normal(0, 1e-3, 49)
    heats = panel_heats(np.stack([peaked, spread / spread.sum()]), 7, 7, (112, 112))
    assert heats.shape == (2, 112, 112)
    assert heats[0].max() == pytest.approx(1.0)
    assert heats[1].max() < 0.2  # 1/49 of the peak's α, on the peak's scale
    assert heats[1].max() - heats[1].min() < 0.05  # and nearly even


def test_a_near_uniform_alpha_renders_a_near_uniform_brightness():
    rng = np.random.default_rng(1)
    alpha = np.full(16, 1 / 16) + rng.normal(0, 1e-3, 16)
    photo = _noise(64, 2)
    (heat,) = panel_heats((alpha / alpha.sum())[None], 4, 4, photo.size)
    shown = np.asarray(brighten(photo, heat), float)
    ratio = shown.sum(-1) / (np.asarray(photo, float).sum(-1) + 1)  # (H, W) brightness kept
    assert ratio.std() < 0.02 and ratio.mean() > 0.95  # the photo, evenly lit


def test_map_rejects_alpha_of_the_wrong_length():
    with pytest.raises(ValueError, match="expected \\(49,\\)"):
        attention_map(np.ones(50), 7, 7, (224, 224))


def test_full_heat_leaves_the_photo_as_it_is_and_none_darkens_it():
    rng = np.random.default_rng(1)
    photo = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(brighten(photo, np.ones((32, 48)))), photo)
    dark = np.asarray(brighten(photo, np.zeros((32, 48))), float)
    assert dark.mean() < 0.2 * np.asarray(photo, float).mean()


def test_centre_crop_keeps_the_middle_of_a_landscape_photo():
    # left third red, middle third green, right third blue: the 30x30 centre crop of a 90x30
    # image resized to short side 30 (no change) is all green
    arr = np.zeros((30, 90, 3), dtype=np.uint8)
    arr[:, :30, 0] = arr[:, 30:60, 1] = arr[:, 60:, 2] = 255
    crop = np.asarray(encoder_view(Image.fromarray(arr), resize=30, crop=30))
    assert crop.shape == (30, 30, 3)
    assert (crop[..., 1] == 255).all() and (crop[..., 0] == 0).all()


def _noise(size: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 245, (size, size, 3), dtype=np.uint8))


@pytest.mark.parametrize("n_words, rows", [(1, [2]), (4, [5]), (7, [5, 3]), (11, [5, 5, 2])])
def test_figure_is_the_photo_then_a_panel_per_word_five_a_row(tmp_path, n_words, rows):
    alphas = np.random.default_rng(3).dirichlet(np.ones(16), size=n_words).astype(np.float32)
    png = draw_attention_figure(
        _noise(56, 0), ["w"] * n_words, alphas, grid_h=4, grid_w=4, columns=5
    )
    (tmp_path / "f.png").write_bytes(png)
    assert [len(row) for row in figure_panels(tmp_path / "f.png")] == rows


def test_the_first_panel_is_the_photo_and_the_next_its_attention(tmp_path):
    ramp = np.linspace(0, 240, 64)
    # smooth, so that drawing it larger changes little
    rgb = np.stack(np.broadcast_arrays(ramp[:, None], ramp, 120), -1)  # (64, 64, 3)
    photo = Image.fromarray(rgb.astype(np.uint8))
    png = draw_attention_figure(photo, ["a"], np.eye(16)[[5]], grid_h=4, grid_w=4)
    (tmp_path / "f.png").write_bytes(png)
    ((first, second),) = figure_panels(tmp_path / "f.png")
    figure = Image.open(tmp_path / "f.png").convert("RGB")

    def shown(box: tuple[int, int, int, int]) -> np.ndarray:  # (64, 64, 3), inside the frame
        x0, y0, x1, y1 = box
        return np.asarray(figure.crop((x0 + 2, y0 + 2, x1 - 2, y1 - 2)).resize((64, 64)), float)

    plain = np.asarray(photo, float)
    assert np.abs(shown(first) - plain).mean() < 0.5 * np.abs(shown(second) - plain).mean()
    # α is all on cell 5 of the 4x4 grid (row 1, column 1): the photo is brightest there
    assert _brightest_cell(shown(second), shown(first), 4) == 5


def _brightest_cell(panel: np.ndarray, photo: np.ndarray, grid: int) -> int:
    """The grid cell where ``panel`` keeps most of ``photo``'s brightness."""
    kept = panel.sum(-1) / (photo.sum(-1) + 1)  # (H, W)
    side = kept.shape[0] // grid
    cells = kept[: side * grid, : side * grid].reshape(grid, side, grid, side).mean((1, 3))
    return int(cells.argmax())


def test_hard_attention_is_drawn_at_the_cell_it_read(tmp_path):
    # α leans to cell 0, but the sampling decoder drew cell 15: the panel shows cell 15
    alphas = np.full((1, 16), 0.02)
    alphas[0, 0] = 0.7
    photo = Image.new("RGB", (64, 64), (200, 180, 160))
    with AttentionFigures(tmp_path, "hard", mode="sample") as figures:
        path = figures.add("x", "x", photo, Attended(["a"], alphas, 4, 4, np.array([15])))
    ((first, second),) = figure_panels(path)
    figure = Image.open(path).convert("RGB")

    def shown(box: tuple[int, int, int, int]) -> np.ndarray:
        x0, y0, x1, y1 = box
        return np.asarray(figure.crop((x0 + 2, y0 + 2, x1 - 2, y1 - 2)).resize((64, 64)), float)

    assert _brightest_cell(shown(second), shown(first), 4) == 15
    (heat,) = panel_heats(alphas, 4, 4, (64, 64), cells=np.array([0]))  # argmax read cell 0
    assert _brightest_cell(np.repeat(heat[..., None], 3, -1), np.ones((64, 64, 3)), 4) == 0


def test_argmax_decoding_read_the_most_attended_cell_expected_and_sample_no_one_cell():
    alphas = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])
    assert attended_cells(alphas, "argmax").tolist() == [1, 0]
    assert attended_cells(alphas, "expected") is None
    assert attended_cells(alphas, "sample") is None  # no draw given
    assert attended_cells(alphas, "sample", np.array([2, 2])).tolist() == [2, 2]
    assert attended_cells(alphas, "expected", np.array([2, 2])) is None


def test_index_lists_each_figure_with_its_name_and_caption_escaped(tmp_path):
    captions = {
        "photos/<b>dog</b>.jpg": ["a", "dog", "&", "<unk>"],
        "other/<b>dog</b>.jpg": ["two", '"cats"'],
    }
    references = [["a dog <runs>", "a brown dog"], []]
    scores = [{"bleu_4": 0.25, "cider": 1.5}, None]
    with AttentionFigures(tmp_path, "soft <attention>") as figures:
        for seed, (label, words) in enumerate(captions.items()):
            alphas = np.random.default_rng(seed).dirichlet(np.ones(16), size=len(words))
            figures.add(
                label,
                "<b>dog</b>",
                _noise(56, seed),
                Attended(words, alphas, 4, 4),
                references=references[seed],
                scores=scores[seed],
            )

    page = read_index(tmp_path)
    assert page.headings == list(captions)
    assert page.captions == [" ".join(w) for w in captions.values()]
    assert page.references == references
    assert page.scores == ["bleu_4 0.250 · cider 1.500", ""]
    # the same stem twice: two files, each named safely, each the figure of its own caption
    assert page.images == ["images/_b_dog__b_.png", "images/_b_dog__b_-2.png"]
    for src, words in zip(page.images, captions.values(), strict=True):
        assert sum(map(len, figure_panels(tmp_path / src))) == len(words) + 1
    assert "<b>" not in (tmp_path / "index.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "index.html"]


def test_an_interrupted_run_still_indexes_the_figures_drawn(tmp_path):
    with pytest.raises(KeyboardInterrupt), AttentionFigures(tmp_path, "t") as figures:
        figures.add("x.jpg", "x", _noise(32, 0), Attended(["a"], np.ones((1, 4)) / 4, 2, 2))
        raise KeyboardInterrupt
    assert read_index(tmp_path).images == ["images/x.png"]


def test_word_and_map_counts_must_agree():
    photo = Image.new("RGB", (16, 16))
    with pytest.raises(ValueError, match="2 words but 1"):
        draw_attention_figure(photo, ["a", "b"], np.ones((1, 4)) / 4, grid_h=2, grid_w=2)
