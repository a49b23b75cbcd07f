"""Every way a photo enters gives the encoder the same pixels, bit for bit.

Real Flickr8k sample photos (JPEGs, some large enough for libjpeg's reduced-scale decode, and a
PNG re-encoding) go through the extract stage's decoding, ``sat caption``'s files, a served
request (raw bytes, base64, a ``data:`` URL) and ``sat caption --engine ray``'s actor decoding;
each must yield the same uint8 tensor. A witness shows the comparison can fail: a photo cut to
its centred square, resized and then cut again (what serving once did) gives other pixels.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipeline.settings import ServeConfig
from sat_model.caption_request import CaptionService
from sat_model.captioner import Captioner
from sat_model.features.extract import ImageItem, decode_batch
from sat_model.features.images import Preprocessing, load_image
from tests.factories import photo_of_another_shape, sample_photos, write_tiny_model

PHOTOS = 6


@pytest.fixture(scope="module", params=[(64, 72, True), (224, 256, True), (64, 64, False)])
def captioner(request, tmp_path_factory) -> Captioner:
    crop, resize, keep_aspect = request.param
    folder = tmp_path_factory.mktemp("model")
    return Captioner.from_dir(
        write_tiny_model(folder, crop=crop, resize=resize, keep_aspect=keep_aspect), max_length=2
    )


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Sample JPEGs (most of the sample is 224 x 224) and one of another shape, also as a PNG
    and scaled up to a size libjpeg decodes at a reduced scale."""
    wide = photo_of_another_shape()
    folder = tmp_path_factory.mktemp("photos")
    with Image.open(wide) as image:
        image.save(folder / "as.png")
        image.resize((image.width * 3, image.height * 3)).save(folder / "big.jpg", quality=90)
    return [*sample_photos(PHOTOS), wide, folder / "as.png", folder / "big.jpg"]


def _served(captioner: Captioner, values: list[object]) -> list[torch.Tensor]:
    prepared = CaptionService(captioner, ServeConfig()).prepare(values)
    assert not prepared.errors, prepared.errors
    return [prepared.images[i] for i in range(len(values))]


def _ray_actor_pixels(captioner: Captioner, data: bytes) -> torch.Tensor:
    """What ``sat caption --engine ray``'s actor makes of a file's bytes (no cluster needed:
    the actor's decoding is plain Python; its __init__ alone needs Ray)."""
    from dataclasses import replace

    from pipeline.ray.caption import _CaptionActor

    actor = object.__new__(_CaptionActor)
    actor.preprocessing = replace(captioner.preprocessing, max_pixels=50_000_000)
    pixels = actor._decode(data)
    assert isinstance(pixels, torch.Tensor), pixels
    return pixels


def test_every_way_in_gives_the_same_pixels(captioner: Captioner, photos: list[Path]) -> None:
    prep = captioner.preprocessing
    items = [ImageItem(p.stem, str(p)) for p in photos]
    extracted = decode_batch(items, replace_limit(prep)).images  # (N, 3, S, S) uint8
    assert extracted.shape == (len(photos), 3, prep.crop, prep.crop)
    offline = [c.caption.pixels for c in captioner.caption_files(photos)]
    data = [p.read_bytes() for p in photos]
    text = [base64.b64encode(d).decode() for d in data]
    media = ["image/png" if p.suffix == ".png" else "image/jpeg" for p in photos]
    urls = [f"data:{m};base64,{t}" for m, t in zip(media, text, strict=True)]
    ways = {
        "sat caption": offline,
        "served bytes": _served(captioner, data),
        "served base64": _served(captioner, text),
        "served data: URL": _served(captioner, urls),
        "sat caption --engine ray": [_ray_actor_pixels(captioner, d) for d in data],
    }
    for way, tensors in ways.items():
        for photo, pixels, expected in zip(photos, tensors, extracted, strict=True):
            assert pixels.dtype == torch.uint8, way
            assert torch.equal(pixels, expected), f"{way} differs from extract on {photo.name}"


def replace_limit(prep: Preprocessing) -> Preprocessing:
    """The extract stage's preprocessing for the same encoder view (its own limit)."""
    return Preprocessing(prep.resize, prep.crop, 50_000_000, keep_aspect=prep.keep_aspect)


def test_a_second_resize_would_change_the_pixels() -> None:
    # the witness: the double resize serving once did is told apart by the comparison above
    prep, wide = Preprocessing(256, 224), photo_of_another_shape()
    photo = load_image(wide, min_side=prep.resize)
    side = min(photo.size)
    left, top = (photo.width - side) // 2, (photo.height - side) // 2
    square = photo.resize(
        (prep.resize, prep.resize),
        Image.Resampling.BILINEAR,
        box=(left, top, left + side, top + side),
    )
    assert not torch.equal(prep.cut(square), prep.pixels(wide))


def test_a_request_path_string_is_never_read_as_a_file(tmp_path: Path) -> None:
    captioner = Captioner.from_dir(write_tiny_model(tmp_path / "m"), max_length=2)
    path = tmp_path / "photo.png"
    buffer = io.BytesIO()
    Image.new("RGB", (80, 80), (200, 10, 10)).save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())
    prepared = CaptionService(captioner, ServeConfig()).prepare([str(path)])
    assert not prepared.images
    assert "not an image" in prepared.errors[0]
