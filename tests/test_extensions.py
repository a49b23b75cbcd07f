"""An extension is one file: a toy metric (with its label and direction) and a toy data source
(with settings of its own), each written as one new module outside the repository and
registered through the ``sat.plugins`` entry points, reach everything that reads their
registries: params accept them, the sweep optimises the metric, ``sat summary`` and the docs'
results tables label it, and prepare reads the source's settings from params.yaml."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from pipeline.cli.main import main as sat
from pipeline.docs.results import build_sections
from pipeline.ray.tune import objective
from pipeline.settings import load_params
from sat_model.config import ParamsError
from sat_model.data.prepare import prepare_dataset
from sat_model.data.sources.registry import SOURCES
from sat_model.evaluation import metrics
from sat_model.train.validation import validation_metrics

METRIC_FILE = """
from sat_model.evaluation.metrics import register_metric


@register_metric("toy_length", ("toy_words",), labels={"toy_words": "Words"}, direction="min")
def toy_length(gts, res, options):
    words = [len(h[0].split()) for h in res.values()]
    return {"toy_words": sum(words) / len(words)}
"""

SOURCE_FILE = '''
from pydantic import Field

from sat_model.config import Section
from sat_model.data.sources.records import SourceCaption, SourceData, SourceImage
from sat_model.data.sources.registry import register_source


class ToyLinesConfig(Section):
    """Tab-separated lines: file, split, caption."""

    captions_file: str = Field("captions.txt", description="the lines, under data.root")


@register_source("toy_lines", settings=ToyLinesConfig)
def read(settings, root, prepared_dir, workers):
    images, captions = {}, []
    for n, line in enumerate((root / settings.captions_file).read_text().splitlines()):
        file, split, caption = line.split("\\t")
        images.setdefault(file, SourceImage(file, split, file))
        captions.append(SourceCaption(file, caption, f"line {n + 1}"))
    return SourceData("toy_lines", root.resolve(), tuple(images.values()), tuple(captions))
'''


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two modules and the entry points naming them, on sys.path for this test only."""
    folder = tmp_path / "plugins"
    (folder / "toy_plugins-0.dist-info").mkdir(parents=True)
    (folder / "toy_length_metric.py").write_text(METRIC_FILE)
    (folder / "toy_lines_source.py").write_text(SOURCE_FILE)
    info = folder / "toy_plugins-0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugins\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[sat.plugins]\nmetric = toy_length_metric\nsource = toy_lines_source\n"
    )
    for table in (SOURCES, metrics._METRICS):  # the toy entries leave with the test
        monkeypatch.setattr(table, "_entries", dict(table._entries))
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    yield
    for name in ("toy_length_metric", "toy_lines_source"):
        sys.modules.pop(name, None)


def _project(root: Path, monitor: str = "toy_words") -> Path:
    (root / "toy").mkdir(parents=True)
    lines = []
    for i in range(10):
        colour = ("red", "blue")[i % 2]
        Image.new("RGB", (32, 32), (200, 30, 30) if colour == "red" else (30, 30, 200)).save(
            root / "toy" / f"{i}.png"
        )
        split = "train" if i < 6 else ("val" if i < 8 else "test")
        lines += [f"{i}.png\t{split}\ta {colour} square", f"{i}.png\t{split}\ta {colour} thing"]
    # the params name this file; the settings' default (captions.txt) does not exist
    (root / "toy" / "mine.txt").write_text("\n".join(lines) + "\n")
    params = root / "params.yaml"
    params.write_text(
        "data:\n  source: toy_lines\n  root: toy\n  toy_lines: {captions_file: mine.txt}\n"
        "  vocab: {min_count: 1}\n"
        f"train:\n  monitor: {monitor}\n"
    )
    return params


def test_a_metric_and_a_source_in_one_file_each_reach_every_reader(
    plugins: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = load_params(_project(tmp_path))
    assert params.train.monitor == "toy_words"
    # the sweep optimises the monitored score in its registered direction, and validation
    # scores it every epoch
    assert objective(params) == ("val_toy_words", "min")
    assert validation_metrics(params.train.monitor) == ("bleu", "cider", "toy_length")
    # prepare reads the source's own settings from params.yaml
    prepared = prepare_dataset(params.data, tmp_path)
    assert prepared.report["images_ok"] == 10
    # sat summary and the docs' results tables head the score with the metric's label
    (tmp_path / "reports" / "soft").mkdir(parents=True)
    scores = {"bleu_4": 0.25, "cider": 0.5, "toy_words": 3.0}
    (tmp_path / "reports" / "soft" / "metrics.json").write_text(json.dumps(scores))
    assert sat(["summary", "--reports", str(tmp_path / "reports")]) == 0
    header, soft = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[-1] == "Words" and soft.split()[-1] == "3.0000"
    assert "| Words |" in build_sections(tmp_path)["scenes"]


def test_a_monitor_no_metric_reports_is_refused_with_the_key(plugins: None, tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"train\.monitor: 'toy_lines' is not a key"):
        load_params(_project(tmp_path, monitor="toy_lines"))
