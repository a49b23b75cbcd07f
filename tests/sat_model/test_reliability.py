"""Security properties of the library that no single module's tests cover.

Every ``torch.load`` in the source tree refuses pickled code (``weights_only=True``, checked on
the syntax tree, so a call split over lines or aliased through ``torch`` is still seen), no
module unpickles anything else, and a tampered ``images.parquet`` cannot make extraction or
evaluation open a file outside the image root.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sat_model.evaluation.evaluate import (
    DecodedCaption,
    FeatureView,
    read_image_records,
    write_attention_gallery,
)
from sat_model.features.extract import read_image_table
from tests.factories import ROOT

SOURCE_DIRS = ("sat_model", "pipeline", "benchmarks", "tests")


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _calls(tree: ast.AST, dotted: str) -> list[ast.Call]:
    """Calls whose function is written ``dotted`` (e.g. ``torch.load``)."""
    attr = dotted.rpartition(".")[2]
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr  # cheap first: unparse only the candidates
        and ast.unparse(node.func) == dotted
    ]


def _weights_only_true(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def test_every_torch_load_in_the_source_tree_passes_weights_only_true() -> None:
    files = _python_files()
    assert len(files) > 20, "the scan found too few files to mean anything"
    found, unsafe = 0, []
    for path in files:
        for call in _calls(_tree(path), "torch.load"):
            found += 1
            if not _weights_only_true(call):
                unsafe.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found >= 3  # checkpoint and encoder loading at least: the scan does see them
    assert unsafe == []


def test_the_scan_would_catch_an_unsafe_torch_load() -> None:
    # the checker itself, on code it must reject and code it must accept
    bad = ast.parse("import torch\ntorch.load(p)\ntorch.load(p, weights_only=False)\n")
    good = ast.parse("torch.load(\n    p,\n    map_location='cpu',\n    weights_only=True,\n)\n")
    assert [_weights_only_true(c) for c in _calls(bad, "torch.load")] == [False, False]
    assert [_weights_only_true(c) for c in _calls(good, "torch.load")] == [True]


UNPICKLERS = (
    "pickle.load",
    "pickle.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "joblib.load",
    "torch.jit.load",
    "dill.load",
    "dill.loads",
)


def test_library_and_pipeline_never_unpickle() -> None:
    hits = []
    for path in _python_files():
        if path.is_relative_to(ROOT / "tests"):
            continue  # tests build malicious pickles on purpose
        tree = _tree(path)
        for name in UNPICKLERS:
            hits += [f"{path.relative_to(ROOT)}:{c.lineno} {name}" for c in _calls(tree, name)]
        hits += [
            f"{path.relative_to(ROOT)}:{node.value.lineno} allow_pickle"
            for node in ast.walk(tree)
            if isinstance(node, ast.keyword)
            and node.arg == "allow_pickle"
            and not (isinstance(node.value, ast.Constant) and node.value.value is False)
        ]
    assert hits == []


# ------------------------------------------------------------ paths never leave the image root
def _table(root: Path, files: dict[str, str]) -> Path:
    table = pa.table(
        {
            "image_id": list(files),
            "split": ["test"] * len(files),
            "file": list(files.values()),
            "width": pa.array([40] * len(files), pa.int32()),
            "height": pa.array([40] * len(files), pa.int32()),
            "status": ["ok"] * len(files),
        }
    ).replace_schema_metadata({"image_root": str(root / "images"), "source": "flickr8k"})
    path = root / "images.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture
def escaping_table(tmp_path: Path) -> Path:
    """An image root with one photo, a photo outside it, and rows that try to reach it."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 40), (200, 10, 10)).save(tmp_path / "images" / "inside.png")
    Image.new("RGB", (40, 40), (10, 200, 10)).save(tmp_path / "secret.png")
    (tmp_path / "images" / "link.png").symlink_to(tmp_path / "secret.png")
    return _table(
        tmp_path,
        {
            "inside": "inside.png",
            "dotdot": "../secret.png",
            "absolute": str(tmp_path / "secret.png"),
            "symlink": "link.png",
            "sneaky": "sub/../../secret.png",
        },
    )


def test_extract_table_reader_refuses_every_path_out_of_the_root(escaping_table: Path) -> None:
    (items,) = read_image_table(escaping_table, escaping_table.parent / "images").values()
    refused = {i.image_id: i.refused for i in items}
    assert refused["inside"] == ""
    for image_id in ("dotdot", "absolute", "symlink", "sneaky"):
        assert "escapes the image root" in refused[image_id], image_id


def test_evaluation_gallery_never_opens_a_photo_out_of_the_root(
    escaping_table: Path, tmp_path: Path
) -> None:
    records = read_image_records(escaping_table, "test", escaping_table.parent / "images")
    alphas = np.full((2, 4), 0.25)  # (len, L): a 2x2 grid, uniform attention
    captions = [DecodedCaption(i, ("a", "circle"), alphas, -1.0) for i in sorted(records)]
    _, skipped = write_attention_gallery(
        captions,
        records,
        tmp_path / "gallery",
        count=len(captions),
        view=FeatureView(2, 2, 40, 32),
        title="t",
    )
    reasons = {s["item"]: s["reason"] for s in skipped}
    assert set(reasons) == {"dotdot", "absolute", "symlink", "sneaky"}
    assert all("escapes the image root" in r for r in reasons.values())
    assert len(list((tmp_path / "gallery" / "images").glob("*.png"))) == 1  # "inside" only
