"""The drift statistic: a Mahalanobis distance of mean-pooled features under a shrunk covariance,
thresholded at a quantile of held-out photos of the training distribution."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sat_model.captioner import Captioner
from sat_model.features.drift import DriftStatistics, fit_drift, fit_stores
from sat_model.features.spec import EncoderSpec
from sat_model.features.store import FeatureStore, FeatureWriter
from tests.factories import write_tiny_model

D = 8


def _covariance() -> np.ndarray:
    """A known covariance (D, D): variances 9 to 1 along random orthogonal directions."""
    rotation, _ = np.linalg.qr(np.random.default_rng(42).standard_normal((D, D)))
    return rotation @ np.diag(np.linspace(9.0, 1.0, D)) @ rotation.T


def _draws(seed: int, n: int) -> np.ndarray:
    """``n`` draws (n, D) of the Gaussian of mean (0, 1, ..., D-1) and :func:`_covariance`."""
    return np.random.default_rng(seed).multivariate_normal(np.arange(float(D)), _covariance(), n)


def test_distance_is_the_mahalanobis_distance_of_the_true_covariance() -> None:
    train = _draws(0, 20_000)
    stats = fit_drift(train, train[:100], components=D)
    centred = np.random.default_rng(1).standard_normal((5, D)) * 3  # (5, D) from the mean
    exact = np.sqrt(np.einsum("bi,ij,bj->b", centred, np.linalg.inv(_covariance()), centred))
    # 20,000 draws: the estimate is within a few per cent, and the shrinkage almost nil
    np.testing.assert_allclose(stats.distances(centred + np.arange(D)), exact, rtol=0.05)


def test_the_threshold_flags_about_one_in_a_hundred_held_out_draws() -> None:
    train, held_out = _draws(2, 4_000), _draws(3, 6_000)
    stats = fit_drift(train, held_out[:1_000], components=3)  # low rank: the rest share one
    flagged = stats.distances(held_out[1_000:]) > stats.threshold
    assert 0.003 < flagged.mean() < 0.03, flagged.mean()
    shifted = held_out[1_000:1_100] + 4 * np.sqrt(np.diag(_covariance()))  # 4 sd on each axis
    assert (stats.distances(shifted) > stats.threshold).all()


def test_few_photos_in_more_dimensions_still_give_finite_distances() -> None:
    # 6 photos in 32 dimensions: the sample covariance is singular; the shrunk one is not
    rng = np.random.default_rng(2)
    stats = fit_drift(rng.standard_normal((6, 32)), rng.standard_normal((3, 32)))
    far = stats.distances(rng.standard_normal((4, 32)) + 10)
    assert np.isfinite(far).all() and (far > stats.threshold).all()


def test_statistics_survive_config_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    stats = fit_drift(rng.standard_normal((50, D)), rng.standard_normal((10, D)))
    (tmp_path / "config.json").write_text(json.dumps({"drift": stats.to_config()}))
    again = DriftStatistics.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert again == stats
    assert DriftStatistics.from_config({"model": {}}) is None  # a folder from before drift
    broken = {**stats.to_config(), "variances": [1.0]}  # k = 1 variance for 7 directions
    with pytest.raises(ValueError, match="drift section is malformed"):
        DriftStatistics.from_config({"drift": broken})


SPREAD = np.array([1.0, -1.0, 0.5, -0.5])[None, :, None]  # (1, L, 1): averages to 0 over L


def _store(path: Path, pooled: np.ndarray) -> FeatureStore:
    """A store whose photos' 4 locations average to ``pooled`` (N, D)."""
    spec = EncoderSpec("random", "none", 32, 4, D, 2, 2, "0" * 64)
    with FeatureWriter(path, spec) as writer:
        writer.write([f"p{i}" for i in range(len(pooled))], pooled[:, None, :] + SPREAD)
    return FeatureStore(path)


def test_stores_give_the_statistics_of_their_pooled_features(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    train, val = rng.standard_normal((40, D)), rng.standard_normal((8, D))
    from_stores = fit_stores(_store(tmp_path / "t.arrow", train), _store(tmp_path / "v.arrow", val))
    # the store holds float16: the statistics are those of the rounded locations' mean
    stored = [
        (x[:, None, :] + SPREAD).astype(np.float16).astype(float).mean(1) for x in (train, val)
    ]
    assert from_stores == fit_drift(*stored)
    # a single training photo has no spread to measure: drift is absent, not an error
    one = _store(tmp_path / "one.arrow", train[:1])
    assert fit_stores(one, FeatureStore(tmp_path / "v.arrow")) is None


def test_a_model_folder_without_statistics_captions_with_drift_absent(tmp_path: Path) -> None:
    captioner = Captioner.from_dir(write_tiny_model(tmp_path / "m"), max_length=4)
    (found,) = captioner.caption([Image.new("RGB", (80, 60), (200, 30, 30))])
    assert captioner.drift is None and found.drift is None and found.words


def test_a_model_folder_with_statistics_scores_each_photo(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    captioner = Captioner.from_dir(model, max_length=4)
    pixels = torch.stack(
        [
            captioner.preprocessing.cut(Image.new("RGB", (72, 72), c))
            for c in ((200, 30, 30), (30, 30, 200))
        ]
    )
    pooled = captioner.encoder.annotate(pixels).float().mean(1).numpy()  # (2, D)
    # the red photo is the training distribution: flagged is the blue one only
    rng = np.random.default_rng(5)
    spread = pooled[0].std() * 0.01 + 1e-3
    captioner.drift = fit_drift(
        pooled[0] + rng.normal(0, spread, (30, pooled.shape[1])),
        pooled[0] + rng.normal(0, spread, (10, pooled.shape[1])),
    )
    red, blue = captioner.caption_pixels(pixels)
    assert red.drift is not None and blue.drift is not None
    assert not red.drift.drifted and blue.drift.drifted
