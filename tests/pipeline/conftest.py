"""Shared pipeline test fixtures: one local Ray cluster and one tiny project per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before any test module imports ray: Ray reads this once at import and would otherwise move
# a single-machine cluster off loopback (see pipeline.ray.runtime).
import pipeline.ray.runtime  # noqa: F401


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """A local Ray cluster (2 CPUs, loopback, no dashboard) shared by the whole session.

    Yields the ``ray`` module. Ray is started once: start-up costs seconds on two cores.
    """
    from pipeline.ray.runtime import ray_session
    from pipeline.settings import RayConfig

    with ray_session(RayConfig(num_cpus=2), address="local"):
        import ray

        yield ray


TINY_L, TINY_D = 4, 6


def _write_tiny_inputs(root: Path) -> None:
    """Prepared captions, vocab and a random-encoder feature store per ARCHITECTURE.md."""
    import numpy as np

    from sat_model.data.vocab import build_vocab, save_vocab
    from sat_model.features.spec import EncoderSpec
    from sat_model.features.store import FeatureWriter
    from tests.factories import write_captions

    rng = np.random.default_rng(1)
    rows, feats = [], {}
    for split, n in (("train", 16), ("val", 4)):
        ids, vecs = [], []
        for i in range(n):
            image_id, colour = f"{split}{i}", ("red", "blue", "green", "white")[i % 4]
            vec = (rng.standard_normal((TINY_L, TINY_D)) * 0.1).astype(np.float16)  # (L, D)
            vec[:, i % 4] += 2.0  # the colour is readable from the features
            ids.append(image_id)
            vecs.append(vec)
            for k, shape in enumerate(("circle", "square")):
                rows.append((image_id, split, k, ["a", colour, shape]))
        feats[split] = (ids, np.stack(vecs))  # (N, L, D)
    prepared = root / "data" / "prepared"
    prepared.mkdir(parents=True)
    write_captions(prepared / "captions.parquet", [(*r[:3], " ".join(r[3])) for r in rows])
    save_vocab(build_vocab([r[3] for r in rows], 1, 50, 20), prepared / "vocab.json")
    spec = EncoderSpec("random", "none", 32, TINY_L, TINY_D, 2, 2, "0" * 64)
    for split, (ids, vecs) in feats.items():
        with FeatureWriter(root / "data" / "features" / f"{split}.arrow", spec) as writer:
            writer.write(ids, vecs)


TINY_PARAMS = """\
model: {embed_dim: 8, hidden_dim: 16, attention_dim: 8, dropout: 0.0}
train:
  val_images: 4
  val_max_length: 5
  soft: {batch_size: 4, max_epochs: 2, lr: 0.01}
  hard: {batch_size: 4, max_epochs: 2, lr: 0.01}
ray: {num_cpus: 2, num_workers: 1, cpus_per_worker: 1, max_failures: 1}
tune:
  num_samples: 3
  max_concurrent: 2
  max_epochs: 2
  grace_period: 1
"""


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder with tiny prepared data, features and a params.yaml (paths relative)."""
    root = tmp_path_factory.mktemp("tiny_project")
    _write_tiny_inputs(root)
    (root / "params.yaml").write_text(TINY_PARAMS)
    return root
