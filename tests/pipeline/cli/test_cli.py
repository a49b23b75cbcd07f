"""The `sat` commands and the evaluate/register stages on a tiny project in tmp_path.

The project has a prepared test split with boxes, a feature store, and a tiny model over the
seeded `random` encoder; MLflow is the project's default SQLite store (no server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from pipeline.cli.main import main
from pipeline.stages import register
from sat_model.features.encoders import build_encoder
from sat_model.features.store import FeatureWriter
from tests.factories import write_references, write_tiny_model
from tests.figures import figure_panels, read_index

IDS = ["t0", "t1", "t2"]
PARAMS = """\
encoder: {name: random, resize: 72, crop: 64}
eval: {beam_size: 2, max_length: 4, length_penalty: {soft: 1.5}, gallery_images: 2,
       meteor_timeout_s: 120.0}
"""


def _write_project(root):
    images = root / "data" / "prepared" / "images"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    box = dict(
        label="large red circle",
        shape="circle",
        colour="red",
        size="large",
        x0=0.0,
        y0=0.0,
        x1=80.0,
        y1=60.0,
    )
    rows, pixels = [], []
    for image_id in IDS:
        photo = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
        photo.save(images / f"{image_id}.png")
        rows.append(
            dict(
                image_id=image_id,
                split="test",
                file=f"{image_id}.png",
                width=80,
                height=60,
                status="ok",
                boxes=[box],
            )
        )
        pixels.append(photo)
    table = pa.Table.from_pylist(rows).replace_schema_metadata(
        {"image_root": str(images), "source": "synthetic"}
    )
    pq.write_table(table, root / "data" / "prepared" / "images.parquet")
    write_references(
        root / "data" / "prepared" / "captions.parquet", {i: ["a red circle"] for i in IDS}
    )
    write_tiny_model(root / "models" / "soft", resize=72)
    encoder = build_encoder("random", input_size=64)
    from sat_model.features.images import preprocess

    d = encoder.spec
    batch = torch.stack([preprocess(p, 72, 64, d.mean, d.std) for p in pixels])  # (B, 3, S, S)
    with FeatureWriter(root / "data" / "features" / "test.arrow", d) as writer:
        writer.write(IDS, encoder(batch).detach().numpy())
    (root / "params.yaml").write_text(PARAMS)


@pytest.fixture
def project(tmp_path, monkeypatch):
    _write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.mark.slow
def test_caption_with_a_model_folder_reports_bad_images_and_keeps_going(project, capsys):
    bad = project / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    good = project / "data" / "prepared" / "images" / "t0.png"
    code = main(
        ["caption", str(good), str(bad), "--model", "models/soft", "--attention-out", "overlays"]
    )
    out, err = capsys.readouterr()
    assert code == 0
    (line,) = out.strip().splitlines()
    words = line.split(": ", 1)[1].split()
    assert len(words) == 4 and set(words) <= {"a", "red", "circle"}
    assert "bad.jpg: error: cannot decode" in err
    assert read_index(project / "overlays").images == ["images/t0.png"]  # one figure, no bad.jpg
    assert sum(map(len, figure_panels(project / "overlays/images/t0.png"))) == 1 + 4


@pytest.mark.slow
def test_attention_out_draws_a_figure_per_real_photo_and_an_index_of_them(tmp_path):
    photos = _sample_photos(3)
    model = write_tiny_model(tmp_path / "model", crop=224)  # a 14x14 grid, as in the paper
    (tmp_path / "params.yaml").write_text("eval: {beam_size: 2, max_length: 6}\n")
    sat = Path(sys.executable).with_name("sat")
    out = subprocess.run(
        [sat, "caption", *map(str, photos), "--model", str(model), "--attention-out", "figs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    captions = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert list(captions) == [str(p) for p in photos]

    figures = tmp_path / "figs"
    assert sorted(p.name for p in figures.iterdir()) == ["images", "index.html"]
    assert sorted(p.name for p in (figures / "images").iterdir()) == sorted(
        f"{p.stem}.png" for p in photos
    )
    index = read_index(figures)
    assert index.headings == list(captions)
    assert index.captions == list(captions.values())
    for photo, src in zip(photos, index.images, strict=True):
        assert src == f"images/{photo.stem}.png"
        rows = figure_panels(figures / src)
        words = captions[str(photo)].split()
        assert sum(map(len, rows)) == len(words) + 1  # the photo, then a panel per word
        assert all(len(row) <= 5 for row in rows)


def _sample_photos(n: int) -> list[Path]:
    from sat_model.paths import shared_data

    root = shared_data("flickr8k-sample") / "Flickr8k_Dataset"
    if not root.is_dir():
        pytest.skip(f"the Flickr8k sample is absent ({root})")
    return sorted(root.glob("*.jpg"))[:n]


def test_caption_fails_when_no_image_is_usable(project, capsys):
    (project / "bad.jpg").write_bytes(b"not a jpeg")
    assert main(["caption", "bad.jpg", "missing.png", "--model", "models/soft"]) == 1
    err = capsys.readouterr().err
    assert "bad.jpg: error: cannot decode" in err and "missing.png: error: file not found" in err


def test_caption_of_only_missing_files_says_so_before_looking_for_a_model(project, capsys):
    assert main(["caption", "missing.png", "gone/"]) == 1  # the champion: absent too
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "sat caption: error: no such file or folder: missing.png gone/"
    assert not (project / "mlflow.db").exists()


def _evaluate_soft(project):
    """`sat evaluate --attention soft`: its metrics, pointing accuracy and attention gallery;
    returns the metrics."""
    assert main(["evaluate", "--attention", "soft"]) == 0
    metrics = json.loads((project / "reports/soft/metrics.json").read_text())
    assert {"bleu_4", "meteor", "rouge_l", "cider", "pointing_accuracy"} <= set(metrics)
    # the one box covers the whole photo, so every 'circle' hits
    counts = json.loads((project / "reports/soft/captions.json").read_text())
    assert metrics["pointing_accuracy"] == 1.0 or counts["pointing_words"] == 0
    gallery = read_index(project / "reports/soft/attention")
    assert gallery.headings == ["t0", "t1"]  # gallery_images, by id
    assert gallery.images == ["images/000.png", "images/001.png"]
    for src in gallery.images:  # the photo, then 4 words
        assert sum(map(len, figure_panels(project / "reports/soft/attention" / src))) == 1 + 4
    return metrics


def _register_in_the_params_store(project):
    """A store named in params (not the default mlflow.db) is the one every command uses; the
    register stage makes version 1 the champion, then reuses it. Returns the store's URI."""
    store = project / "elsewhere.db"
    with (project / "params.yaml").open("a") as f:
        f.write(f"mlflow: {{tracking_uri: 'sqlite:///{store}'}}\n")
    assert register.main([]) == 0
    assert store.exists() and not (project / "mlflow.db").exists()
    report = json.loads((project / "reports/registry.json").read_text())
    assert report["champion"] == "1" and report["versions"][0]["reused"] is False
    assert report["skipped"] == [{"item": "hard", "reason": "no model or no metrics"}]
    assert register.main([]) == 0  # the same checkpoint again: no second version
    report = json.loads((project / "reports/registry.json").read_text())
    assert report["versions"][0] == {**report["versions"][0], "version": "1", "reused": True}
    return f"sqlite:///{store}"


def _summary_models_and_promote_name_the_champion(capsys, metrics):
    """`sat summary`, `sat models` and `sat promote` on the registry with version 1."""
    # `make run` ends with `sat summary`: the champion as a user asks for it, by name and version
    capsys.readouterr()
    assert main(["summary"]) == 0
    champion = f"champion: sat-captioner version 1 (soft attention, bleu_4 {metrics['bleu_4']:.4f})"
    assert champion in capsys.readouterr().out.splitlines()

    capsys.readouterr()
    assert main(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 and table[1].split()[0] == "1" and table[1].endswith("champion")
    assert f"{metrics['bleu_4']:7.4f}".strip() in table[1]

    assert main(["promote", "--metric", "cider"]) == 0
    assert "version 1" in capsys.readouterr().out
    assert main(["promote", "--version", "7"]) == 1


def _caption_with_the_champion(project, capsys):
    """`sat caption` with no --model captions with the champion, in process and as the installed
    command; a model name nobody registered fails with one line."""
    image = project / "data" / "prepared" / "images" / "t1.png"
    assert main(["caption", str(image)]) == 0  # default: models:/sat-captioner@champion
    assert capsys.readouterr().out.startswith(f"{image}: ")
    # the installed command, as a user runs it: the caption alone
    sat = [str(Path(sys.executable).parent / "sat"), "caption", str(image)]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    quiet = subprocess.run(sat, cwd=project, env=env, capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert quiet.stdout.startswith(f"{image}: ") and len(quiet.stdout.splitlines()) == 1
    verbose = subprocess.run([*sat, "-v"], cwd=project, env=env, capture_output=True, text=True)
    # -v lets MLflow's own output through (its download progress bar); the caption is the same
    assert verbose.returncode == 0 and verbose.stdout == quiet.stdout

    assert main(["caption", str(image), "-S", "mlflow.model_name=absent"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sat caption: error: no champion model registered as ")
    assert "models:/absent@champion" in line and "make run" in line


def _another_length_penalty_is_a_new_version(project, capsys, tracking):
    """The same checkpoint scored with another length penalty: a new version, served that way,
    while the champion stays version 1."""
    text = (project / "params.yaml").read_text().replace("{soft: 1.5}", "{soft: 0.0}")
    # a floor no model of this project reaches (CIDEr's ceiling is 10): registered, not promoted
    (project / "params.yaml").write_text(text + "promotion: {floor: {cider: 10.0}}\n")
    assert main(["evaluate", "--attention", "soft"]) == 0
    capsys.readouterr()
    assert register.main([]) == 0
    said = capsys.readouterr().out
    assert "; version 2 not promoted: cider " in said and "is below the floor 10.0000" in said
    report = json.loads((project / "reports/registry.json").read_text())
    assert report["versions"][0] == {**report["versions"][0], "version": "2", "reused": False}
    assert _served_length_penalty(tracking, "models:/sat-captioner/2") == 0.0
    assert _served_length_penalty(tracking, "models:/sat-captioner/1") == 1.5
    assert register.main([]) == 0  # and that one is found again
    report = json.loads((project / "reports/registry.json").read_text())
    assert report["versions"][0] == {**report["versions"][0], "version": "2", "reused": True}
    # the champion stays version 1, registered by an earlier run: the summary still names it
    assert (report["champion"], report["champion_attention"]) == ("1", "soft")
    capsys.readouterr()
    assert main(["summary"]) == 0
    assert "champion: sat-captioner version 1 (soft attention" in capsys.readouterr().out


@pytest.mark.java
@pytest.mark.mlflow
@pytest.mark.slow
def test_evaluate_register_models_promote_and_caption_the_champion(project, capsys):
    metrics = _evaluate_soft(project)
    tracking = _register_in_the_params_store(project)
    _the_served_champion_decodes_as_it_was_evaluated(project, tracking)
    capsys.readouterr()
    assert main(["card"]) == 0  # the champion's card: the scores reports/ holds
    card = capsys.readouterr().out
    assert all(f"| {k} | {v:.4f} |" in card for k, v in metrics.items())
    _summary_models_and_promote_name_the_champion(capsys, metrics)
    _caption_with_the_champion(project, capsys)

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as env:  # as in a fresh shell: no earlier command's quiet
        env.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
        assert main(["evaluate", "--model", "models:/sat-captioner@champion"]) == 0
    assert (project / "reports/eval/sat-captioner@champion/metrics.json").exists()
    shown = capsys.readouterr()
    assert "Downloading artifacts" not in shown.err and shown.out.startswith("evaluate: test")

    _another_length_penalty_is_a_new_version(project, capsys, tracking)


def _served_length_penalty(tracking, uri):
    import mlflow

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", tracking)
        served = mlflow.pyfunc.load_model(uri)
    return served.unwrap_python_model().service.captioner.length_penalty


def _the_served_champion_decodes_as_it_was_evaluated(project, tracking):
    # loaded as `sat serve` loads it (MLflow's model config replaced by the serve section), the
    # registered model decodes with the eval section it was scored with (beam 2, 4 steps, soft's
    # length penalty 1.5), not the Captioner's defaults: the same caption as `sat caption`'s
    import base64

    import mlflow
    import pandas as pd

    from sat_model.captioner import Captioner

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", tracking)
        served = mlflow.pyfunc.load_model(
            "models:/sat-captioner@champion", model_config={"serve": {"max_rows": 4}}
        )
    captioner = served.unwrap_python_model().service.captioner
    assert (captioner.beam_size, captioner.max_length, captioner.length_penalty) == (2, 4, 1.5)
    image = project / "data" / "prepared" / "images" / "t1.png"
    (row,) = served.predict(
        pd.DataFrame({"image": [base64.b64encode(image.read_bytes()).decode()]})
    ).to_dict("records")
    local = Captioner.from_dir(
        project / "models" / "soft", beam_size=2, max_length=4, length_penalty={"soft": 1.5}
    )
    (expected,) = local.caption_files([image])
    assert row["error"] is None and row["caption"] == expected.caption.text


@pytest.mark.java
@pytest.mark.slow
def test_evaluate_of_a_named_model_never_writes_another_stage_output(project):
    write_tiny_model(project / "models" / "hard", resize=72, attention="hard")
    assert main(["evaluate", "--model", "models/hard"]) == 0
    out = project / "reports" / "eval" / "hard"
    assert {"bleu_4", "meteor", "cider"} <= set(json.loads((out / "metrics.json").read_text()))
    assert "hard attention" in (out / "attention" / "index.html").read_text()
    assert sorted(p.name for p in (project / "reports").iterdir()) == ["eval"]


def test_summary_of_a_profile_names_its_params_in_the_caption_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make run PROFILE=flickr8k` ends with `sat summary --reports profiles/flickr8k/reports`:
    the hint must caption with that profile's champion, not the default pipeline's."""
    from pipeline.cli.main import main as sat

    scores = {"bleu_1": 0.6, "bleu_4": 0.2, "meteor": 0.2, "rouge_l": 0.45, "cider": 0.5}
    for root in (tmp_path, tmp_path / "profiles" / "flickr8k"):
        (root / "reports" / "soft").mkdir(parents=True)
        (root / "reports" / "soft" / "metrics.json").write_text(json.dumps(scores))
    monkeypatch.chdir(tmp_path)
    assert sat(["summary", "--reports", "profiles/flickr8k/reports"]) == 0
    out = capsys.readouterr().out
    assert "0.5000" in out and "sat caption --params profiles/flickr8k/params.yaml " in out
    assert sat(["summary"]) == 0
    assert "sat caption path/to/image.jpg" in capsys.readouterr().out
