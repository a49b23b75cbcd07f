"""Drift: how far a photo's encoder features lie from the training photos' features.

Dimensions: ``N`` photos, ``B`` batch, ``L`` locations, ``D`` annotation size, ``k`` kept
principal directions.

The statistic (docs/METHOD.md, "Drift") is the Mahalanobis distance of a photo's mean-pooled
annotation vector ``x = mean_i a_i`` (D,) from the training photos' mean, under their covariance
shrunk towards a scaled identity (Ledoit and Wolf, 2004: the shrinkage that minimises the expected
error, so a small training set still gives an invertible, well-conditioned covariance). The
covariance is kept as its ``k`` largest eigenpairs plus one variance shared by every other
direction, so the statistics stay small (``(k + 1) x D`` numbers) for any encoder. The threshold is
the ``quantile`` of the same distance over the validation photos: held-out photos of the training
distribution, so about ``1 - quantile`` of such photos are flagged, whatever the encoder's scale.

The statistics travel as the ``drift`` section of a model folder's ``config.json`` (JSON, no
pickle), written at training time from the feature stores; a model folder without it captions
with drift absent (``None``), never an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from sat_model.features.store import FeatureStore

__all__ = [
    "COMPONENTS",
    "QUANTILE",
    "DriftScore",
    "DriftStatistics",
    "drift_fields",
    "drift_note",
    "fit_drift",
    "fit_stores",
    "pooled_features",
]

# The statistic's two settings: k principal directions kept apart (the rest share one variance,
# so the statistics stay (k + 1) x D numbers for any encoder), and the quantile of the validation
# photos' distances that is the threshold (about 1 in 100 photos of the training distribution is
# flagged).
COMPONENTS = 32
QUANTILE = 0.99
STATISTIC = "mahalanobis-shrunk-mean-pooled"
_CHUNK = 64


@dataclass(frozen=True)
class DriftScore:
    """One photo's distance from the training features, and whether it passes the threshold."""

    score: float
    drifted: bool


@dataclass(frozen=True)
class DriftStatistics:
    """The training features' mean, shrunk covariance (k eigenpairs + a residual variance) and
    the threshold; ``score`` gives each photo's distance."""

    mean: tuple[float, ...]  # (D,)
    components: tuple[tuple[float, ...], ...]  # (k, D) orthonormal rows
    variances: tuple[float, ...]  # (k,) shrunk eigenvalues
    residual_variance: float  # every other direction's shrunk variance
    threshold: float  # the quantile of the validation photos' scores
    quantile: float
    train_images: int
    val_images: int
    statistic: str = STATISTIC

    def to_config(self) -> dict[str, Any]:
        """The ``drift`` section of ``config.json``."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DriftStatistics | None:
        """The statistics a checkpoint's config records; None when it records none (older
        folders) or another statistic.

        Raises:
            ValueError: a ``drift`` section whose fields or shapes do not fit together.
        """
        section = config.get("drift")
        if not isinstance(section, Mapping) or section.get("statistic") != STATISTIC:
            return None
        try:
            stats = cls(
                mean=tuple(map(float, section["mean"])),
                components=tuple(tuple(map(float, row)) for row in section["components"]),
                variances=tuple(map(float, section["variances"])),
                residual_variance=float(section["residual_variance"]),
                threshold=float(section["threshold"]),
                quantile=float(section["quantile"]),
                train_images=int(section["train_images"]),
                val_images=int(section["val_images"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the drift section is malformed: {type(e).__name__}: {e}") from None
        dims, k = len(stats.mean), len(stats.variances)
        if len(stats.components) != k or any(len(row) != dims for row in stats.components):
            raise ValueError(f"the drift section is malformed: {k} variances, D = {dims}")
        return stats

    def distances(self, pooled: np.ndarray) -> np.ndarray:
        """Mahalanobis distances (B,) of mean-pooled features (B, D)."""
        d = np.asarray(pooled, dtype=np.float64) - np.asarray(self.mean)  # (B, D)
        u = np.asarray(self.components, dtype=np.float64).reshape(-1, d.shape[1])  # (k, D)
        projected = d @ u.T  # (B, k)
        rest = np.maximum((d * d).sum(1) - (projected * projected).sum(1), 0.0)  # (B,)
        squared = (projected**2 / np.asarray(self.variances)).sum(1) + rest / self.residual_variance
        distances: np.ndarray = np.sqrt(squared)
        return distances

    def score(self, annotations: torch.Tensor) -> list[DriftScore]:
        """Each photo's score from its annotation vectors (B, L, D), as the encoder gives them."""
        pooled = annotations.float().mean(1).cpu().numpy()  # (B, D)
        return [DriftScore(float(s), bool(s > self.threshold)) for s in self.distances(pooled)]


def pooled_features(store: FeatureStore) -> np.ndarray:
    """Every photo's mean-pooled annotation vector (N, D), float64, from a feature store."""
    out = np.empty((len(store), store.spec.D))
    for start in range(0, len(store), _CHUNK):
        rows = np.arange(start, min(start + _CHUNK, len(store)))
        out[rows] = store.get_batch(rows).astype(np.float64).mean(1)  # (B, D)
    return out


def fit_drift(
    train: np.ndarray,
    val: np.ndarray,
    *,
    components: int = COMPONENTS,
    quantile: float = QUANTILE,
) -> DriftStatistics:
    """Statistics of the training photos' pooled features ``train`` (N, D), thresholded at the
    ``quantile`` of the validation photos' ``val`` (M, D) distances."""
    if len(train) < 2 or len(val) < 1:
        raise ValueError(
            f"drift statistics need 2 training and 1 validation photo, got {len(train)}, {len(val)}"
        )
    from sklearn.covariance import ledoit_wolf

    mean = train.mean(0)  # (D,)
    # the covariance shrunk towards tr(S)/D · I (Ledoit-Wolf): N photos, D >> N dimensions
    covariance, _ = ledoit_wolf(train - mean, assume_centered=True)  # (D, D)
    mu = np.trace(covariance) / covariance.shape[0]  # shrinking keeps the trace
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)  # ascending
    shrunk = eigenvalues[::-1]  # (D,) descending
    k = min(components, len(shrunk) - 1)
    residual = float(shrunk[k:].mean())
    if not (residual > 0 and math.isfinite(residual)):  # every photo alike: nothing to measure
        residual = max(float(mu), 1e-12)
    partial = DriftStatistics(
        mean=tuple(mean.tolist()),
        components=tuple(map(tuple, eigenvectors[:, ::-1][:, :k].T.tolist())),
        variances=tuple(np.maximum(shrunk[:k], residual * 1e-6).tolist()),
        residual_variance=residual,
        threshold=math.inf,
        quantile=quantile,
        train_images=len(train),
        val_images=len(val),
    )
    threshold = float(np.quantile(partial.distances(val), quantile))
    return DriftStatistics(**{**asdict(partial), "threshold": threshold})


def fit_stores(train: FeatureStore, val: FeatureStore) -> DriftStatistics | None:
    """:func:`fit_drift` on two feature stores; None when they hold too few photos to measure
    (the model then captions with drift absent)."""
    if len(train) < 2 or len(val) < 1:
        return None
    return fit_drift(pooled_features(train), pooled_features(val))


def drift_note(flagged: int, scored: int) -> str:
    """The batch summary's words for ``flagged`` of ``scored`` photos past the threshold."""
    return (
        f"{flagged} of {scored} photos far from the training photos (drift past the model's "
        "threshold): their captions are guesses"
    )


def drift_fields(drift: DriftScore | None) -> dict[str, Any]:
    """A captioned row's ``drift`` (the score) and ``drifted`` (past the threshold) fields, as
    every output carries them; null when the model records no statistics or the row has no
    photo."""
    if drift is None:
        return {"drift": None, "drifted": None}
    return {"drift": drift.score, "drifted": drift.drifted}
