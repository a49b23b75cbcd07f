"""Fixtures for the whole suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _isolated_mlflow_tracking_uri() -> Iterator[None]:
    """Each test starts and ends with the tracking URI it found.

    ``mlflow.set_tracking_uri`` (tests call it to load a registered model) also exports
    ``MLFLOW_TRACKING_URI``, which ``pipeline.tracking.runs`` honours first: without this, one
    test's server would become every later test's store.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        from mlflow.tracking._tracking_service import utils

        utils._tracking_uri = None
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, with the reason, where PyTorch sees no CUDA device."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to PyTorch here")
    for item in gpu:
        item.add_marker(skip)
