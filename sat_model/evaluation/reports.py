"""The reports folder (``eval.reports_dir``): its file names and layout, spelled here only.

- ``<attention>/``: the evaluate stage's report on the stage's own model (written by
  :func:`sat_model.evaluation.evaluate.write_reports`): ``metrics.json`` (the scores alone, the
  project's ``dvc metrics``), ``captions.json`` and the attention gallery ``attention/`` (an
  :class:`~sat_model.evaluation.visualize.AttentionFigures` folder, which owns what is inside).
- ``eval/<model name>/``: the same report on a model named with ``sat evaluate --model``, so that
  it never overwrites a stage's DVC output.
- ``registry.json``: the register stage's record (versions, promotions, the champion).
- ``extract_timing.json``: the extract stage's engine and speed, a local record outside DVC.

No torch here: ``sat summary`` and the register stage read the folder without the model's stack.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "CAPTIONS_FILE",
    "EXTRACT_TIMING_FILE",
    "GALLERY_DIR",
    "METRICS_FILE",
    "NAMED_MODELS_DIR",
    "REGISTRY_FILE",
    "read_metrics",
]

METRICS_FILE = "metrics.json"
CAPTIONS_FILE = "captions.json"
GALLERY_DIR = "attention"  # the attention gallery: index.html and its figures
NAMED_MODELS_DIR = "eval"  # reports on models named with --model, one folder each
REGISTRY_FILE = "registry.json"
EXTRACT_TIMING_FILE = "extract_timing.json"


def read_metrics(report_dir: Path) -> dict[str, float] | None:
    """The scores in ``report_dir/metrics.json``; None when that model was not evaluated."""
    path = report_dir / METRICS_FILE
    if not path.is_file():
        return None
    metrics: dict[str, float] = json.loads(path.read_text(encoding="utf-8"))
    return metrics
