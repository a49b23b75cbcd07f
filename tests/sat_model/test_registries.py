"""Extension points are registries: a toy encoder, data source and metric added through their
registries alone (no other file changes) are accepted by params and run by the stages' code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from torch import nn

from sat_model.config import EncoderConfig, ParamsError
from sat_model.data import sources
from sat_model.data.prepare import prepare_dataset
from sat_model.data.sources.registry import SOURCES
from sat_model.evaluation import metrics
from sat_model.features import encoders
from sat_model.features.extract import extract_features
from sat_model.features.store import FeatureStore
from sat_model.params import load_params, validate_params

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh copies of the three tables, so the toy entries leave with the test."""
    for table in (encoders._ENCODERS, SOURCES, metrics._METRICS):
        monkeypatch.setattr(table, "_entries", dict(table._entries))


def _register_toys() -> None:
    @encoders.register_encoder("toy_pool", ("pool4",))
    def toy_pool(layer: str, weights: Path | None, seed: int) -> encoders.Trunk:
        return encoders.Trunk(nn.AdaptiveAvgPool2d(4), "toy-pool")  # (B, 3, 4, 4): L=16, D=3

    @sources.register_source("toy_lines")
    def toy_lines(settings, root, prepared_dir, workers):  # type: ignore[no-untyped-def]
        images, captions = [], []
        for n, line in enumerate((root / "captions.txt").read_text().splitlines()):
            file, split, caption = line.split("\t")
            images.append(sources.SourceImage(file, split, file))
            captions.append(sources.SourceCaption(file, caption, f"captions.txt line {n + 1}"))
        return sources.SourceData("toy_lines", root.resolve(), tuple(images), tuple(captions))

    @metrics.register_metric("length", ("mean_length",))
    def length(gts, res, options):  # type: ignore[no-untyped-def]
        words = [len(h[0].split()) for h in res.values()]
        return {"mean_length": sum(words) / len(words)}


def _toy_dataset(root: Path) -> None:
    root.mkdir()
    lines = []
    for i in range(12):
        name = list(COLOURS)[i % 3]
        Image.new("RGB", (40, 30), COLOURS[name]).save(root / f"{i}.png")
        split = "train" if i < 8 else ("val" if i < 10 else "test")
        lines += [f"{i}.png\t{split}\ta {name} square", f"{i}.png\t{split}\ta plain {name} thing"]
    (root / "captions.txt").write_text("\n".join(lines) + "\n")


def test_a_toy_encoder_source_and_metric_run_through_their_registries(
    registries: None, tmp_path: Path
) -> None:
    _register_toys()
    _toy_dataset(tmp_path / "toy")
    params = tmp_path / "params.yaml"
    params.write_text(
        "data: {source: toy_lines, root: toy, required_splits: [train, val, test],"
        " vocab: {min_count: 1}}\nencoder: {name: toy_pool}\n"
    )
    loaded = load_params(params)  # params accept the new names, from the tables alone
    assert (loaded.data.source, loaded.encoder.name) == ("toy_lines", "toy_pool")
    prepared = prepare_dataset(loaded.data, tmp_path)
    assert prepared.report["images_ok"] == 12
    encoder = encoders.build_encoder("toy_pool", input_size=32)
    assert encoder.spec.num_locations == 16 and encoder.spec.annotation_dim == 3
    extract_features(
        tmp_path / "data/prepared/images.parquet",
        sources.image_root(loaded.data, tmp_path),
        tmp_path / "features",
        encoder,
        EncoderConfig(resize=32, crop=32, batch_size=4, num_workers=0, max_image_pixels=10_000),
        progress=False,
    )
    store = FeatureStore(tmp_path / "features" / "train.arrow")
    (red,) = store.get_batch([store.index_of("0.png")])  # (L, D): a red photo pooled is red
    assert red.shape == (16, 3) and bool((red[:, 0] > red[:, 2]).all())
    hypotheses = {"a": "a red square", "b": "a plain blue thing here"}
    references = {"a": ["a red square"], "b": ["a blue square"]}
    if shutil.which("java") is None:
        pytest.skip("PTB tokenisation needs Java")
    scores = metrics.score_captions(hypotheses, references, metrics=["bleu", "length"])
    assert scores["mean_length"] == pytest.approx(4.0) and scores["bleu_1"] > 0
    assert metrics.metric_keys()[-1] == "mean_length"  # the report's keys follow the table


def test_an_unregistered_name_is_refused_with_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown encoder 'nope'; registered: \['efficientnet"):
        validate_params({"encoder": {"name": "nope"}})
    with pytest.raises(ValueError, match=r"unknown data source 'nope'; registered: \["):
        validate_params({"data": {"source": "nope"}})
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['nope'\]"):
        metrics.score_captions({"a": "x"}, {"a": ["x"]}, metrics=["nope"])


def test_a_name_registers_once(registries: None) -> None:
    with pytest.raises(ValueError, match="registered already"):
        encoders.register_encoder("random", ("conv2",))(lambda layer, weights, seed: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="registered already"):
        sources.register_source("folder")(lambda *a: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="registered already"):
        metrics.register_metric("bleu", ("bleu_1",))(lambda *a: {})


def test_params_name_an_unknown_encoder_with_the_key(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("encoder: {name: efficientnet_b7}\n")
    with pytest.raises(ParamsError, match=r"encoder\.name"):
        load_params(params)
