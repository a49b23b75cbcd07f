"""The encoder's spec: config.json round trip, older sections read, rebuilding checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sat_model.features.encoders import build_encoder, rebuild_encoder
from sat_model.features.spec import EncoderError, EncoderSpec


def test_config_section_round_trips_the_spec_and_its_preprocessing() -> None:
    built = build_encoder("random", input_size=64).spec
    recorded = replace(built, resize=80, keep_aspect=False)
    read = EncoderSpec.from_config({"encoder": recorded.to_config()}, "x")
    # mean/std are not recorded: the rebuilt network gives them back
    assert read == replace(recorded, mean=None, std=None)
    assert rebuild_encoder(read).spec == built


def test_a_config_section_written_before_issue_47_is_read() -> None:
    # train wrote the store's metadata fields, its format_version included, then the preprocessing
    section = {
        "name": "random",
        "layer": "conv2",
        "input_size": 64,
        "num_locations": 16,
        "annotation_dim": 32,
        "grid_h": 4,
        "grid_w": 4,
        "weights_sha256": "random-seed-3",
        "format_version": 1,
        "resize": 72,
        "keep_aspect": True,
    }
    spec = EncoderSpec.from_config({"encoder": section}, "x")
    assert (spec.L, spec.D, spec.resize, spec.keep_aspect, spec.seed) == (16, 32, 72, True, 3)


def test_a_recorded_shape_the_network_does_not_give_is_refused() -> None:
    spec = replace(build_encoder("random", input_size=64).spec, grid_h=5, num_locations=20)
    with pytest.raises(EncoderError, match="rebuilt gives"):
        rebuild_encoder(spec)


def test_normalisation_is_known_only_once_built() -> None:
    built = build_encoder("random", input_size=32).spec
    assert built.normalization() == (built.mean, built.std)
    with pytest.raises(EncoderError, match="normalisation unknown"):
        replace(built, mean=None).normalization()


def test_a_spec_without_resize_has_no_config_section() -> None:
    with pytest.raises(EncoderError, match="no resize"):
        build_encoder("random", input_size=32).spec.to_config()
