"""The encoder's spec: which frozen network gave the annotation vectors, and how to rebuild it.

Dimensions: ``S`` input size (square crop), ``grid_h × grid_w`` feature grid, ``L = grid_h ·
grid_w`` locations, ``D`` channels.

The encoder is three types: ``sat_model.config.EncoderConfig`` (the params),
:class:`EncoderSpec` (this module) and ``sat_model.features.encoders.Encoder`` (the module,
carrying its spec). A spec is what a built encoder says about itself, what a feature store's
metadata records (``sat_model.features.store``), what a model folder's ``config.json``
``encoder`` section records (with the photos' preprocessing) and what a Ray actor rebuilds the
driver's encoder from: ``sat_model.features.encoders.rebuild_encoder`` rebuilds it and checks
that the rebuilt network is the recorded one, weights checksum included.

The module holds no network code and imports no other module of sat_model, so the store can
read a spec without the encoders' module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["EncoderError", "EncoderSpec"]

# the names an older feature store or model config.json gave the encoder's fields: still read,
# so older stores and checkpoints stay usable
_LEGACY_KEYS = {"encoder": "name", "L": "num_locations", "D": "annotation_dim"}
# the recorded fields, in the order stores and config.json write them (a store's bytes, and so
# DVC's hash of the features, depend on it)
_RECORDED = (
    "name",
    "layer",
    "input_size",
    "num_locations",
    "annotation_dim",
    "grid_h",
    "grid_w",
    "weights_sha256",
)
_INT_FIELDS = frozenset({"input_size", "num_locations", "annotation_dim", "grid_h", "grid_w"})
# the paper's preprocessing (resize 256, crop 224) when a model folder does not record resize
_DEFAULT_RESIZE_RATIO = 256 / 224
_MAX_RESIZE_RATIO = 4

Triple = tuple[float, float, float]


class EncoderError(RuntimeError):
    """Unknown encoder or layer, unusable weights, or a recorded encoder that cannot be
    rebuilt as recorded."""


@dataclass(frozen=True)
class EncoderSpec:
    """A frozen encoder's identity (network, layer, crop, weights checksum), the shape of what
    it yields, its input normalisation and, as a model folder records it, the photos'
    preprocessing before the crop."""

    name: str  # a registered encoder (sat_model.features.encoders.list_encoders)
    layer: str
    input_size: int  # S
    num_locations: int  # L
    annotation_dim: int  # D
    grid_h: int
    grid_w: int
    weights_sha256: str  # sha256 of the weights file, or "random-seed-N"
    # per-channel input normalisation: a built encoder's (a store or config.json does not
    # record it; the rebuilt network gives it back)
    mean: Triple | None = None
    std: Triple | None = None
    # the shorter side before the centre crop and whether the aspect ratio is kept
    # (encoder.resize / encoder.keep_aspect at training time): only a model's config.json
    # records them, for new photos to be preprocessed as the training photos were
    resize: int | None = None
    keep_aspect: bool = True

    @property
    def L(self) -> int:  # the paper's symbol
        return self.num_locations

    @property
    def D(self) -> int:  # the paper's symbol
        return self.annotation_dim

    @property
    def seed(self) -> int:
        """The "random" encoder's seed, which its checksum names (``random-seed-N``); 0 for a
        network with real weights."""
        return int(self.weights_sha256.rsplit("-", 1)[-1]) if self.name == "random" else 0

    def normalization(self) -> tuple[Triple, Triple]:
        """``(mean, std)`` the encoder's input is normalised with; known once built."""
        if self.mean is None or self.std is None:
            raise EncoderError(f"encoder {self.name!r}: normalisation unknown until it is built")
        return self.mean, self.std

    def to_fields(self) -> dict[str, object]:
        """The recorded fields, in their stored order (a store's metadata, the extract report
        and a model's config.json all start with them)."""
        return {key: getattr(self, key) for key in _RECORDED}

    @classmethod
    def from_fields(cls, raw: Mapping[str, object]) -> EncoderSpec:
        """From recorded fields (numbers as text too, other keys ignored, older names read).

        Raises:
            KeyError: a field is missing (the key names it).
            ValueError: a number field is not an integer.
        """
        given = {_LEGACY_KEYS.get(k, k): v for k, v in raw.items()}
        values: dict[str, Any] = {}
        for key in _RECORDED:
            if key not in given:
                raise KeyError(key)
            value = given[key]
            values[key] = int(str(value)) if key in _INT_FIELDS else str(value)
        return cls(**values)

    def to_config(self) -> dict[str, object]:
        """A model's ``config.json`` ``encoder`` section: the recorded fields, ``resize`` and
        ``keep_aspect``."""
        if self.resize is None:
            raise EncoderError(f"encoder {self.name!r}: no resize to record")
        return {**self.to_fields(), "resize": self.resize, "keep_aspect": self.keep_aspect}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str | Path) -> EncoderSpec:
        """The encoder a model folder's ``config.json`` records (``source`` names the folder in
        errors); without ``resize``, the paper's 256/224 of the crop, without ``keep_aspect``,
        true.

        Raises:
            EncoderError: no ``encoder`` section, a missing or invalid field.
        """
        section = config.get("encoder")
        if not isinstance(section, dict):
            raise EncoderError(f"{source}: config.json has no 'encoder' section")
        try:
            spec = cls.from_fields(section)
        except KeyError as e:
            raise EncoderError(f"{source}: config.json 'encoder' lacks {e.args[0]!r}") from e
        except ValueError as e:
            raise EncoderError(f"{source}: config.json 'encoder' is invalid: {e}") from e
        size = spec.input_size
        resize = section.get("resize") or round(size * _DEFAULT_RESIZE_RATIO)
        # memory grows with resize², so a config from elsewhere is held near the crop it feeds
        top = _MAX_RESIZE_RATIO * size
        if not isinstance(resize, int) or not size <= resize <= top:
            raise EncoderError(
                f"{source}: config.json 'encoder' resize {str(resize)[:20]} is outside "
                f"{size}..{top} (the encoder's crop to 4 times it)"
            )
        keep_aspect = section.get("keep_aspect", True)
        if not isinstance(keep_aspect, bool):
            raise EncoderError(f"{source}: config.json 'encoder' keep_aspect is not true/false")
        return replace(spec, resize=resize, keep_aspect=keep_aspect)
