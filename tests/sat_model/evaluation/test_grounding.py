"""Pointing accuracy: crop geometry, cell centres and the hit rule, on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from sat_model.data.tables import Box
from sat_model.evaluation.grounding import (
    GroundingSample,
    box_to_crop,
    cell_centre,
    crop_geometry,
    peak_hits_box,
    pointing_accuracy,
)


def test_square_image_at_crop_size_is_identity():
    g = crop_geometry(224, 224, resize=224, crop=224)
    assert (g.scale_x, g.scale_y, g.left, g.top) == (1.0, 1.0, 0, 0)


def test_square_image_resized_then_cropped_by_hand():
    # 224 -> 256 (scale 8/7), crop 224 leaves (256-224)/2 = 16 on each side
    g = crop_geometry(224, 224, resize=256, crop=224)
    b = box_to_crop(Box(14, 28, 70, 224), g)
    assert (b.x0, b.y0, b.x1, b.y1) == pytest.approx((0.0, 16.0, 64.0, 240.0))


def test_landscape_image_crops_the_long_side():
    # 500x375 -> short side 256: scale 256/375, long side int(256*500/375) = int(341.33) = 341;
    # left offset round((341-224)/2) = round(58.5) = 58 (banker's rounding, as torchvision)
    g = crop_geometry(500, 375, resize=256, crop=224)
    assert g.top == round((256 - 224) / 2) == 16
    assert g.left == 58
    assert g.scale_x == pytest.approx(341 / 500)
    assert g.scale_y == pytest.approx(256 / 375)


def test_without_keep_aspect_both_sides_scale_to_resize_and_nothing_is_cut():
    # 500x375 squeezed to 256x256, crop 224: the scales differ per axis, both offsets are 16
    g = crop_geometry(500, 375, resize=256, crop=224, keep_aspect=False)
    assert (g.scale_x, g.scale_y) == pytest.approx((256 / 500, 256 / 375))
    assert (g.left, g.top) == (16, 16)
    whole = crop_geometry(500, 375, resize=224, crop=224, keep_aspect=False)
    b = box_to_crop(Box(0, 0, 500, 375), whole)  # the whole photo is the whole crop
    assert (b.x0, b.y0, b.x1, b.y1) == pytest.approx((0.0, 0.0, 224.0, 224.0))


def test_geometry_matches_torchvision_resize_and_centre_crop():
    # independent reference: put one white pixel in a portrait image, run torchvision's own
    # transforms and check it lands where crop_geometry says
    width, height, x, y = 300, 420, 170, 250
    img = torch.zeros(1, height, width)
    img[0, y, x] = 1.0
    out = v2.CenterCrop(224)(v2.Resize(256, antialias=False)(img))
    ys, xs = np.unravel_index(int(out[0].argmax()), tuple(out[0].shape))
    g = crop_geometry(width, height, resize=256, crop=224)
    # pixel centres map as (x + 0.5) * scale - 0.5 for nearest-free bilinear sampling
    assert (x + 0.5) * g.scale_x - 0.5 - g.left == pytest.approx(xs, abs=1.0)
    assert (y + 0.5) * g.scale_y - 0.5 - g.top == pytest.approx(ys, abs=1.0)


def test_cell_centres_of_a_7x7_grid_over_224():
    # each cell is 32 px: cell 0 is centred at (16, 16), cell 8 (row 1, col 1) at (48, 48),
    # the last cell at (208, 208)
    assert cell_centre(0, 7, 7, 224) == (16.0, 16.0)
    assert cell_centre(8, 7, 7, 224) == (48.0, 48.0)
    assert cell_centre(48, 7, 7, 224) == (208.0, 208.0)
    # row-major: index 3 is row 0, column 3
    assert cell_centre(3, 7, 7, 224) == (112.0, 16.0)


def test_cell_index_outside_the_grid_is_rejected():
    with pytest.raises(ValueError, match="49"):
        cell_centre(49, 7, 7, 224)


def _one_hot(index: int, size: int = 4) -> np.ndarray:
    alpha = np.full(size, 0.1 / (size - 1))
    alpha[index] = 0.9
    return alpha


def test_peak_hit_and_miss_on_a_2x2_grid():
    # 2x2 over 100 px: centres (25,25) (75,25) (25,75) (75,75)
    box = [Box(50, 0, 100, 50)]  # top-right quadrant
    assert peak_hits_box(_one_hot(1), box, 2, 2, 100)
    assert not peak_hits_box(_one_hot(0), box, 2, 2, 100)
    assert not peak_hits_box(_one_hot(3), box, 2, 2, 100)


def test_alpha_of_the_wrong_length_is_rejected():
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        peak_hits_box(np.ones(5) / 5, [Box(0, 0, 1, 1)], 2, 2, 100)


def _by_label(words, boxes):
    return [tuple(i for i, b in enumerate(boxes) if b.label == w) for w in words]


def _sample(words, alphas, boxes, width, height):
    return GroundingSample(alphas, boxes, _by_label(words, boxes), width, height)


def test_pointing_accuracy_counts_only_words_that_name_objects():
    boxes = [Box(0, 0, 50, 50, "circle"), Box(50, 50, 100, 100, "square")]
    words = ["a", "circle", "and", "a", "square"]
    # 'circle' looks top-left (cell 0, hit); 'square' looks top-right (cell 1, miss)
    alphas = np.stack([_one_hot(3), _one_hot(0), _one_hot(2), _one_hot(2), _one_hot(1)])
    sample = _sample(words, alphas, boxes, width=100, height=100)
    result = pointing_accuracy([sample], grid_h=2, grid_w=2, resize=100, crop=100)
    assert (result.hits, result.total) == (1, 2)
    assert result.accuracy == 0.5


def test_word_naming_two_objects_hits_either():
    boxes = [Box(0, 0, 50, 50, "circle"), Box(50, 50, 100, 100, "circle")]
    sample = _sample(["circle"], _one_hot(3)[None], boxes, width=100, height=100)
    result = pointing_accuracy([sample], grid_h=2, grid_w=2, resize=100, crop=100)
    assert result.accuracy == 1.0


def test_boxes_are_moved_into_the_crop_before_the_test():
    # 200x100 landscape, resize 100 keeps it, crop 100 cuts x in [50, 150): a box at original
    # x in [50, 100] becomes [0, 50] in the crop: the top-left cell (centre 25, 25) hits
    boxes = [Box(50, 0, 100, 50, "circle")]
    sample = _sample(["circle"], _one_hot(0)[None], boxes, width=200, height=100)
    result = pointing_accuracy([sample], grid_h=2, grid_w=2, resize=100, crop=100)
    assert result.accuracy == 1.0
    # without the offset the same box would have covered cell 1 (centre 75, 25), not cell 0
    sample = _sample(["circle"], _one_hot(1)[None], boxes, width=200, height=100)
    result = pointing_accuracy([sample], grid_h=2, grid_w=2, resize=100, crop=100)
    assert result.accuracy == 0.0


def test_no_grounded_word_gives_nan_not_a_score():
    sample = _sample(["a", "b"], np.stack([_one_hot(0)] * 2), [], width=10, height=10)
    result = pointing_accuracy([sample], grid_h=2, grid_w=2, resize=10, crop=10)
    assert result.total == 0
    assert math.isnan(result.accuracy)


def test_targets_must_align_with_the_attention_rows():
    sample = GroundingSample(np.stack([_one_hot(0)] * 2), [], [()], width=10, height=10)
    with pytest.raises(ValueError, match="1 word targets but 2"):
        pointing_accuracy([sample], grid_h=2, grid_w=2, resize=10, crop=10)
