"""``ModelConfig``: everything that rebuilds a ``ShowAttendTell``, saved in checkpoints as JSON.

Dimensions as in docs/METHOD.md: ``K`` vocabulary, ``D`` annotation size, ``L`` locations,
``m`` embedding, ``n`` LSTM, ``A`` attention-MLP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from sat_model.config import ATTENTION_KINDS
from sat_model.data.vocab import END_ID

__all__ = ["SEMI_SAMPLING_PER", "ModelConfig"]

SEMI_SAMPLING_PER = ("image", "batch")


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model; saved in checkpoints as JSON (``asdict``)."""

    vocab_size: int  # K, special tokens included
    annotation_dim: int  # D, fixed by the encoder's feature layer
    num_locations: int  # L, the encoder's grid (14 x 14 = 196 in the paper)
    embed_dim: int  # m
    hidden_dim: int  # n
    attention_dim: int  # A, hidden size of the attention MLP f_att (Eq. 4)
    dropout: float  # before L_o, as in the authors' code
    gate: bool  # gating scalar β_t (Sec. 4.2.1); False fixes β_t = 1
    attention: str  # "soft" (Sec. 4.2) or "hard" (Sec. 4.1)
    # hard attention only: chance of using α instead of s̃ while training (Sec. 4.1), drawn per
    # image (paper text) or once per minibatch (authors' code)
    semi_sampling_p: float = 0.5
    semi_sampling_per: str = "image"
    # beyond the paper: append each cell's (x, y) centre in [-1, 1] to its annotation (D -> D + 2):
    # convolutional features carry almost no position, which captions that name objects left to
    # right and their relations need. Off in older checkpoints.
    coordinates: bool = False
    grid_w: int = 0  # columns of the row-major L = grid_h × grid_w grid (needed for coordinates)
    # standardise every channel of a_i with the training features' mean and std (buffers set by
    # set_feature_statistics): raw CNN activations saturate σ/tanh at the default init
    normalize_features: bool = False
    # beyond the paper: dropout on E y_{t-1} where it enters the LSTM (Eq. 1), in training; the
    # deep output (Eq. 7) still sees the whole embedding. 0 (off) in older checkpoints
    input_dropout: float = 0.0

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "annotation_dim", "num_locations", "embed_dim", "hidden_dim")
        for name in (*sizes, "attention_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size <= END_ID:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room for <pad>/<start>/<end>")
        for name, allowed in (
            ("attention", ATTENTION_KINDS),
            ("semi_sampling_per", SEMI_SAMPLING_PER),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected {allowed}")
        for name in ("dropout", "input_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.semi_sampling_p <= 1.0:
            raise ValueError(f"semi_sampling_p must be in [0, 1], got {self.semi_sampling_p}")
        if self.coordinates and (self.grid_w < 1 or self.num_locations % self.grid_w):
            raise ValueError(
                f"coordinates need grid_w dividing L={self.num_locations}, got {self.grid_w}"
            )
