"""Captioning image files end to end with a tiny saved model and the seeded `random` encoder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from sat_model.captioner import Captioner
from sat_model.features.encoders import EncoderError, build_encoder, rebuild_encoder
from sat_model.features.image_files import find_image_files
from sat_model.features.spec import EncoderSpec
from tests.factories import photo_of_another_shape, write_tiny_model

WORDS = ["a", "red", "blue", "circle", "square", "left", "of"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("model"), words=WORDS, resize=72, real_words_only=False
    )


def _photos(n, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [(80, 60), (64, 64), (50, 90), (120, 70)]
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in (sizes[i % 4] for i in range(n))
    ]


def test_one_caption_per_image_with_one_attention_map_per_word(model_dir):
    captioner = Captioner.from_dir(model_dir, beam_size=2, max_length=6)
    results = captioner.caption(_photos(3))
    assert len(results) == 3
    for r in results:
        assert 0 <= len(r.words) <= 6
        assert set(r.words) <= set(WORDS) | {"<unk>"}
        assert r.alphas.shape == (len(r.words), 16)
        np.testing.assert_allclose(r.alphas.sum(-1), 1.0, atol=1e-5)
        assert (r.grid_h, r.grid_w) == (4, 4)
        assert r.crop.size == (64, 64)  # α is drawn over the crop the encoder saw
        assert r.text == " ".join(r.words)


def test_batching_does_not_change_captions(model_dir):
    photos = _photos(5, seed=3)
    together = Captioner.from_dir(model_dir, batch_size=5).caption(photos)
    one_by_one = Captioner.from_dir(model_dir, batch_size=1).caption(photos)
    assert [r.words for r in together] == [r.words for r in one_by_one]
    for a, b in zip(together, one_by_one, strict=True):
        np.testing.assert_allclose(a.alphas, b.alphas, atol=1e-5)


@pytest.mark.parametrize("attention, expected", [("soft", 0.5), ("hard", 2.0)])
def test_a_length_penalty_given_per_variant_applies_the_models_own(tmp_path, attention, expected):
    model_dir = write_tiny_model(tmp_path, words=WORDS, resize=72, attention=attention)
    per_variant = {"soft": 0.5, "hard": 2.0}
    assert Captioner.from_dir(model_dir, length_penalty=per_variant).length_penalty == expected
    assert Captioner.from_dir(model_dir, length_penalty=3.0).length_penalty == 3.0


@pytest.mark.parametrize("attention, read", [("soft", "expected"), ("hard", "argmax")])
def test_eval_hard_decode_applies_to_the_hard_model_only(tmp_path, attention, read):
    """`sat caption` passes `eval.hard_decode` whatever the model: a soft model decodes with the
    expected context it was trained on, as the evaluate stage scored it."""
    model_dir = write_tiny_model(tmp_path, words=WORDS, resize=72, attention=attention)
    assert Captioner.from_dir(model_dir, mode="argmax").mode == read


def test_missing_encoder_section_is_named(tmp_path):
    with pytest.raises(EncoderError, match="no 'encoder' section"):
        EncoderSpec.from_config({"model": {}}, tmp_path)


def test_encoder_section_missing_a_field_is_named(tmp_path):
    with pytest.raises(EncoderError, match="'grid_h'"):
        EncoderSpec.from_config(
            {
                "encoder": {
                    "name": "random",
                    "layer": "conv2",
                    "input_size": 64,
                    "num_locations": 16,
                    "annotation_dim": 32,
                    "weights_sha256": "",
                }
            },
            tmp_path,
        )


def test_resize_defaults_to_the_papers_ratio_when_not_recorded():
    section = build_encoder("random", input_size=224).spec.to_fields()
    assert EncoderSpec.from_config({"encoder": section}, "x").resize == 256


def test_encoder_with_other_weights_is_refused(tmp_path):
    d = build_encoder("random", input_size=64).spec.to_fields()
    seven = EncoderSpec.from_config({"encoder": {**d, "weights_sha256": "random-seed-7"}}, "x")
    # seed 7 rebuilds a network whose recorded checksum is "random-seed-7": that one matches
    assert rebuild_encoder(seven).spec.weights_sha256 == "random-seed-7"
    lite0 = {**d, "name": "efficientnet_lite0", "layer": "blocks.4", "weights_sha256": "0" * 64}
    with pytest.raises(EncoderError, match="not the ones recorded"):
        rebuild_encoder(EncoderSpec.from_config({"encoder": lite0}, tmp_path))


def test_config_json_encoder_section_round_trips(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    m = EncoderSpec.from_config(config, model_dir)
    assert (m.name, m.input_size, m.resize, m.grid_h) == ("random", 64, 72, 4)


def test_encoder_section_in_the_pre_issue_18_shape_is_still_read():
    # before one shape, train_run recorded the store's metadata names: "encoder", "L", "D"
    section = {"encoder": "random", "layer": "conv2", "input_size": 64, "L": 16, "D": 32}
    section |= {"grid_h": 4, "grid_w": 4, "weights_sha256": "random-seed-0", "format_version": 1}
    recorded = EncoderSpec.from_config({"encoder": section}, "x")
    assert (recorded.name, recorded.resize) == ("random", 73)  # round(64 * 256 / 224)
    assert rebuild_encoder(recorded).spec.num_locations == 16


def test_caption_files_keeps_the_order_and_gives_each_bad_file_its_error(model_dir, tmp_path):
    photos = _photos(5, seed=4)
    paths = []
    for i, photo in enumerate(photos):
        paths.append(tmp_path / f"p{i}.png")
        photo.save(paths[-1])  # lossless: the file decodes to these very pixels
    (tmp_path / "bad.png").write_bytes(b"not a png")
    files = [*paths[:2], tmp_path / "bad.png", *paths[2:], tmp_path / "missing.png"]
    captioner = Captioner.from_dir(model_dir, beam_size=2, max_length=6, batch_size=2)
    found = list(captioner.caption_files(files, workers=2))
    assert [f.path for f in found] == [str(p) for p in files]
    captioned = [f.caption for f in found if f.caption is not None]
    assert [c.words for c in captioned] == [r.words for r in captioner.caption(photos)]
    assert found[2].caption is None and found[2].error.startswith("cannot decode")
    assert found[-1].caption is None and found[-1].error == "file not found"


def test_find_image_files_walks_folders_and_keeps_files_named_explicitly(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/x.JPG", "a/b/y.png", "a/b/z.webp", "a/notes.txt", "a/.hidden.jpeg"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "a" / "b" / "link.jpg").symlink_to(tmp_path / "a" / "x.JPG")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "a" / "b" / "folder_link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "w.jpg").write_bytes(b"")
    os.mkfifo(tmp_path / "a" / "fifo.jpg")  # opening it would wait for a writer forever
    found = find_image_files([tmp_path / "a", tmp_path / "a" / "notes.txt", "absent.jpg"])
    names = [p.relative_to(tmp_path).as_posix() if p.is_absolute() else str(p) for p in found]
    assert names == [
        "a/.hidden.jpeg",
        "a/x.JPG",
        "a/b/link.jpg",
        "a/b/y.png",
        "a/b/z.webp",
        "a/notes.txt",
        "absent.jpg",
    ]


def test_a_model_trained_on_squeezed_photos_sees_a_real_photo_whole(tmp_path):
    # the same weights recorded with keep_aspect false and without it (the shorter side): a real
    # 500x375 JPEG reaches the encoder squeezed whole by one, centre-cropped by the other
    path = photo_of_another_shape()
    common = dict(words=WORDS, crop=64, resize=64)
    squeezed = write_tiny_model(tmp_path / "squeezed", keep_aspect=False, **common)
    cropped = write_tiny_model(tmp_path / "cropped", **common)
    assert EncoderSpec.from_config(_config(squeezed), squeezed).keep_aspect is False
    assert EncoderSpec.from_config(_config(cropped), cropped).keep_aspect is True
    (whole,) = Captioner.from_dir(squeezed).caption_files([path])
    (centre,) = Captioner.from_dir(cropped).caption_files([path])
    assert whole.caption is not None and centre.caption is not None
    with Image.open(path) as photo:
        expected = np.asarray(photo.convert("RGB").resize((64, 64), Image.Resampling.BILINEAR))
    seen = np.asarray(whole.caption.crop, np.float32)
    assert np.abs(seen - expected).mean() < 3  # α is drawn over the whole photo
    assert np.abs(np.asarray(centre.caption.crop, np.float32) - expected).mean() > 10
    assert not np.allclose(whole.caption.alphas[:1], centre.caption.alphas[:1], atol=1e-4)


def test_keep_aspect_other_than_true_or_false_is_refused(tmp_path):
    config = _config(write_tiny_model(tmp_path / "m", keep_aspect=False))
    config["encoder"]["keep_aspect"] = "no"
    with pytest.raises(EncoderError, match="keep_aspect is not true/false"):
        EncoderSpec.from_config(config, tmp_path)


def _config(model_dir):
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("resize", [100_000, 100, "256", True])
def test_a_recorded_resize_far_from_the_crop_is_refused(resize):
    # memory grows with resize²: a config from elsewhere may not ask for a 100,000 px side
    section = build_encoder("random", input_size=224).spec.to_fields()
    with pytest.raises(EncoderError, match=r"resize .* is outside 224\.\.896"):
        EncoderSpec.from_config({"encoder": {**section, "resize": resize}}, "x")
