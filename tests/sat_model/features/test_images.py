"""Decoding, mode conversion, EXIF orientation, bomb guard and preprocessing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sat_model.features.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageError,
    encoder_view,
    load_image,
    preprocess,
)
from tests.factories import photo_of_another_shape


def _save(image: Image.Image, path: Path, **kwargs) -> Path:
    image.save(path, **kwargs)
    return path


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [
        ("L", "png"),
        ("LA", "png"),
        ("P", "png"),
        ("RGBA", "png"),
        ("CMYK", "jpeg"),
        ("I;16", "png"),
        ("I", "tiff"),
        ("F", "tiff"),
        ("1", "png"),
    ],
)
def test_every_mode_loads_as_rgb(tmp_path: Path, mode: str, fmt: str) -> None:
    image = Image.new("RGB", (20, 10), (200, 30, 60)).convert(mode)
    loaded = load_image(_save(image, tmp_path / f"x.{fmt}"))
    assert loaded.mode == "RGB"
    assert loaded.size == (20, 10)


def test_transparent_rgba_pixels_become_white_and_opaque_keep_colour(tmp_path: Path) -> None:
    pixels = np.zeros((2, 2, 4), np.uint8)
    pixels[0, 0] = (10, 20, 30, 255)  # opaque
    pixels[1, 1] = (10, 20, 30, 0)  # fully transparent
    path = _save(Image.fromarray(pixels, "RGBA"), tmp_path / "a.png")
    out = np.asarray(load_image(path))
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert tuple(out[1, 1]) == (255, 255, 255)


def test_palette_with_transparency_composites_on_white(tmp_path: Path) -> None:
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    path = _save(image, tmp_path / "p.png", transparency=0)
    out = np.asarray(load_image(path))
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert tuple(out[0, 1]) == (255, 0, 0)


def test_16_bit_grey_is_scaled_not_clipped(tmp_path: Path) -> None:
    # 0, mid-range and full-scale 16-bit values map to 0, 128 and 255 (x / 257); clipping at 255
    # would turn the middle value white.
    values = np.array([[0, 32896, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    path = _save(image, tmp_path / "g16.png")
    out = np.asarray(load_image(path))[0, :, 0]
    assert out.tolist() == [0, 128, 255]


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    # a 40×20 landscape stored with orientation 6 (rotate 90° clockwise to view) is 20×40 upright;
    # the red left edge of the stored image ends up on top.
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :5] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = _save(Image.fromarray(pixels), tmp_path / "o.jpg", exif=exif, quality=95)
    out = np.asarray(load_image(path))
    assert out.shape == (40, 20, 3)
    assert out[:3, :, 0].mean() > 200 and out[-3:, :, 0].mean() < 50


def test_decompression_bomb_is_refused_with_reason(tmp_path: Path) -> None:
    path = _save(Image.new("L", (4000, 3000)), tmp_path / "big.png")
    assert path.stat().st_size < 100_000  # small file, huge declared size
    with pytest.raises(ImageError, match="decompression bomb") as info:
        load_image(path, max_pixels=1_000_000)
    assert "12000000" in info.value.reason


def test_truncated_file_raises_image_error(tmp_path: Path) -> None:
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    full = _save(Image.fromarray(noise), tmp_path / "full.png").read_bytes()
    path = tmp_path / "cut.png"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(path)


def test_non_image_and_missing_files_raise_image_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(text)
    with pytest.raises(ImageError, match="file not found"):
        load_image(tmp_path / "absent.png")


def test_preprocess_resizes_shorter_side_then_centre_crops() -> None:
    # 300×200 with a 10-pixel white band in the middle column: after the shorter side goes to 48
    # (72×48) and a 32 centre crop, the band is still centred in the crop.
    pixels = np.zeros((200, 300, 3), np.uint8)
    pixels[:, 145:155] = 255
    x = preprocess(Image.fromarray(pixels), resize=48, crop=32, mean=(0,) * 3, std=(1,) * 3)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    column_mean = x[0].mean(0)  # (32,)
    assert column_mean[15:17].min() > 0.9 and column_mean[:5].max() < 0.05


def test_without_keep_aspect_the_edges_of_a_wide_photo_are_kept() -> None:
    # 300×200 with white bands in its first and last 15 columns: the centre crop of the shorter
    # side cuts both bands away; resizing both sides keeps each in the crop's outer columns
    pixels = np.zeros((200, 300, 3), np.uint8)
    pixels[:, :15] = pixels[:, -15:] = 255
    image = Image.fromarray(pixels)
    kept = preprocess(image, resize=32, crop=32, mean=(0,) * 3, std=(1,) * 3)
    whole = preprocess(image, resize=32, crop=32, mean=(0,) * 3, std=(1,) * 3, keep_aspect=False)
    assert kept[0].max() < 0.05  # the bands were outside the centre square
    assert whole[0, :, 0].min() > 0.9 and whole[0, :, -1].min() > 0.9
    assert whole[0, :, 8:24].max() < 0.05
    # resize then the centre crop as before: 40×40, then the middle 32 (band: 2 of 40 columns)
    inner = preprocess(image, resize=40, crop=32, mean=(0,) * 3, std=(1,) * 3, keep_aspect=False)
    assert inner[0].max() < 0.05


def test_encoder_view_without_keep_aspect_is_the_whole_photo_squeezed() -> None:
    photo = load_image(photo_of_another_shape())
    view = np.asarray(encoder_view(photo, 96, 96, keep_aspect=False), np.float32)
    squeezed = np.asarray(photo.resize((96, 96), Image.Resampling.BILINEAR), np.float32)
    centre = np.asarray(encoder_view(photo, 96, 96), np.float32)
    assert view.shape == centre.shape == (96, 96, 3)
    assert np.abs(view - squeezed).mean() < 3  # of 255: the same picture
    assert np.abs(view - centre).mean() > 10


def test_preprocess_normalises_with_given_mean_and_std() -> None:
    image = Image.new("RGB", (8, 8), (255, 0, 128))
    x = preprocess(image, resize=8, crop=8)
    channels = zip((255, 0, 128), IMAGENET_MEAN, IMAGENET_STD, strict=True)
    expected = [(v / 255 - m) / s for v, m, s in channels]
    assert torch.allclose(x[:, 0, 0], torch.tensor(expected), atol=1e-6)


def test_preprocess_rejects_crop_larger_than_resize() -> None:
    with pytest.raises(ValueError, match="crop 64 is larger than resize 32"):
        preprocess(Image.new("RGB", (8, 8)), resize=32, crop=64)


def test_large_jpeg_draft_decode_keeps_shorter_side_at_least_resize(tmp_path: Path) -> None:
    path = _save(Image.new("RGB", (1200, 900), (0, 128, 0)), tmp_path / "big.jpg")
    image = load_image(path, min_side=200)
    assert min(image.size) >= 200 and min(image.size) < 900  # decoded at 1/2 or 1/4 scale


def test_a_file_in_another_format_never_reaches_its_parser(tmp_path: Path) -> None:
    # an EPS named .jpg would be handed to Ghostscript if Pillow tried every plugin
    from unittest import mock

    from PIL import EpsImagePlugin

    eps = tmp_path / "photo.jpg"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n")
    with (
        mock.patch.object(EpsImagePlugin.EpsImageFile, "_open") as opened,
        pytest.raises(ImageError, match="cannot decode"),
    ):
        load_image(eps)
    opened.assert_not_called()
