"""`dvc plots show` on the project's own ``plots:`` section: one plot per curves.csv quantity
with soft and hard attention together, titled and labelled, and the galleries as image plots.

The curves and galleries are written by the test (the real writer for the gallery figures) in a
temporary DVC repository whose dvc.yaml holds the project's plots section.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from sat_model.evaluation.visualize import FIGURES_DIR, Attended, AttentionFigures
from sat_model.train.model_dir import CURVE_COLUMNS
from tests.factories import ROOT

QUANTITIES = [c for c in CURVE_COLUMNS if c != "epoch"]  # each column of curves.csv gets a plot
# per attention, per epoch: values that tell the two files apart in the rendered data
CURVES = {
    "soft": [[1, 3.25, 0.125, 0.375, 0.006], [2, 2.5, 0.25, 0.625, 0.003]],
    "hard": [[1, 4.75, 0.0625, 0.1875, 0.005], [2, 4.5, 0.1875, 0.4375, 0.0025]],
}

pytestmark = pytest.mark.slow


def _write_outputs(repo: Path) -> dict[str, list[str]]:
    """curves.csv per model and a two-word gallery per attention; returns the PNG names."""
    pngs = {}
    for attention, rows in CURVES.items():
        curves = repo / "models" / attention / "curves.csv"
        curves.parent.mkdir(parents=True)
        with curves.open("w", newline="") as f:
            csv.writer(f).writerows([CURVE_COLUMNS, *rows])
        gallery = repo / "reports" / attention / "attention"
        photo = Image.new("RGB", (32, 32), (200, 30, 30))
        alphas = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
        with AttentionFigures(gallery, attention) as figures:  # index.html beside the figures
            figures.add("x", "000", photo, Attended(["a", attention], alphas, 2, 2))
        pngs[attention] = sorted(p.name for p in (gallery / FIGURES_DIR).glob("*.png"))
    return pngs


def _specs(page: str) -> dict[str, dict]:
    """The Vega-Lite spec of each plot on the page, by its plot id (the div's id)."""
    found = re.findall(r'<div id = "([^"]+)">\s*<script[^>]*>\s*var spec = (\{.*?\});\n', page)
    return {plot_id: json.loads(spec) for plot_id, spec in found}


def test_plots_show_draws_each_quantity_for_both_models_and_the_galleries(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": spec["plots"]}))
    pngs = _write_outputs(tmp_path)
    dvc = str(Path(sys.executable).parent / "dvc")
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    out = subprocess.run(
        [dvc, "plots", "show", "-o", "html"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "failed to load" not in out.stdout + out.stderr  # e.g. a page taken for a plot
    page = (tmp_path / "html" / "index.html").read_text()

    specs = _specs(page)
    assert set(specs) == set(QUANTITIES)  # one plot per quantity, not one per file
    for quantity, plot in specs.items():
        assert plot["title"]["text"], quantity
        layer = plot["layer"][0]["encoding"]["y"]
        assert layer["field"] == quantity and layer["title"], quantity
        assert plot["encoding"]["x"]["field"] == "epoch" and plot["encoding"]["x"]["title"]
        column = CURVE_COLUMNS.index(quantity)
        drawn = {
            (p["filename"], float(p["epoch"]), float(p[quantity])) for p in plot["data"]["values"]
        }
        written = {
            (f"{attention}/curves.csv", float(row[0]), float(row[column]))
            for attention, rows in CURVES.items()
            for row in rows
        }
        assert drawn == written, quantity  # both models' curves, on the same axes
    images = re.findall(r'<img src="static/workspace_reports_([^"]+)">', page)
    assert sorted(images) == sorted(
        f"{attention}_attention_{FIGURES_DIR}_{name}"
        for attention, names in pngs.items()
        for name in names
    )
    assert len(images) == 2  # per model: one figure (the photo and a map per word)
