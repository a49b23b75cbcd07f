"""Shared fixtures for the pipeline tests: one local Ray cluster per test session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# Before any test module imports ray: Ray reads this once at import and would otherwise move
# a single-machine cluster off loopback (see pipeline.ray_runtime).
import pipeline.ray_runtime  # noqa: F401


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """A local Ray cluster (2 CPUs, loopback, no dashboard) shared by the whole session.

    Yields the ``ray`` module. Ray is started once: start-up costs seconds on two cores.
    """
    from pipeline.ray_runtime import ray_session
    from sat_model.config import RayConfig

    with ray_session(RayConfig(num_cpus=2), address="local"):
        import ray

        yield ray
