"""Bad input at every entry point: one shared set of bad and odd image files, fed to ``prepare``,
``extract``, ``sat caption`` and the pyfunc model; a truncated feature store fed to training;
bad checkpoints fed to ``sat caption``; bad params fed to every stage's ``main``.

The rule each test checks (docs/RELIABILITY.md): a bad item is skipped with a reason that says
what is wrong, every valid item is still processed, and the run fails loudly only when nothing
usable is left (or when the input is a whole-run input: params, checkpoint, feature store).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import types
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from sat_model.data.vocab import Vocab
from sat_model.model.checkpoint import CheckpointError
from tests.factories import write_tiny_model

# ----------------------------------------------------------------------------- the file zoo
# Valid but unusual files: every entry point must accept them (sat_model.features.images converts
# them).
ODD = (
    "grey.png",
    "grey16.png",
    "cmyk.jpg",
    "palette.png",
    "palette_alpha.png",
    "rgba.png",
    "plain.jpg",
)
# Unusable files, with the words a clear reason must contain (lower case), per entry point
# family: "check" = prepare's header check, "decode" = sat_model.features.images.load_image.
BAD = {
    "empty.jpg": {"check": "empty file", "decode": "cannot decode"},
    "truncated.jpg": {"check": "truncated", "decode": "cannot decode"},
    "text.jpg": {"check": "not a readable image", "decode": "cannot decode"},
    "bomb.png": {"check": "decompression bomb", "decode": "decompression bomb"},
    "missing.jpg": {"check": "missing", "decode": "file not found"},
}


def _noise(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(abs(hash(mode)) % 1000)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)  # (H, W, 3)
    return Image.fromarray(pixels).convert(mode)


def _jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A 1x1 PNG whose header claims ``width`` x ``height``: decoding it would need ~10 GB.

    The IHDR chunk (bytes 8..33: length, type, 13 data bytes, CRC) is rewritten with a valid CRC,
    so only the pixel-count guard, not a checksum error, can refuse it.
    """
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    data = buf.getvalue()
    chunk = bytearray(data[12:29])  # b"IHDR" + 13 data bytes
    chunk[4:12] = struct.pack(">II", width, height)
    return data[:12] + bytes(chunk) + struct.pack(">I", zlib.crc32(bytes(chunk))) + data[33:]


def write_zoo(folder: Path) -> None:
    """Every file of ``ODD`` and ``BAD`` except ``missing.jpg``, under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    size = (48, 40)
    _noise(size, "L").save(folder / "grey.png")
    grey16 = (np.arange(size[0] * size[1], dtype=np.uint16) * 37).reshape(size[1], size[0])
    Image.fromarray(grey16).save(folder / "grey16.png")  # mode I;16, (H, W)
    (folder / "cmyk.jpg").write_bytes(_jpeg(_noise(size, "CMYK")))
    _noise(size).convert("P").save(folder / "palette.png")
    palette = _noise(size).convert("P")
    palette.info["transparency"] = 0
    palette.save(folder / "palette_alpha.png", transparency=0)
    _noise(size, "RGBA").save(folder / "rgba.png")
    (folder / "plain.jpg").write_bytes(_jpeg(_noise(size)))
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "truncated.jpg").write_bytes(_jpeg(_noise((64, 64)))[:700])
    (folder / "text.jpg").write_text("this is a caption, not a picture\n")
    (folder / "bomb.png").write_bytes(bomb_png())


def test_zoo_files_are_what_their_names_say(tmp_path: Path) -> None:
    # guards the fixture itself: the odd files really have the unusual modes
    write_zoo(tmp_path)
    modes = {name: Image.open(tmp_path / name).mode for name in ODD}
    assert modes["grey16.png"].startswith("I;16")
    assert (modes["cmyk.jpg"], modes["palette.png"], modes["rgba.png"]) == ("CMYK", "P", "RGBA")
    assert "transparency" in Image.open(tmp_path / "palette_alpha.png").info
    with open(tmp_path / "bomb.png", "rb") as f:
        assert struct.unpack(">II", f.read()[16:24]) == (100_000, 100_000)


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------------- prepare
def _flickr_layout(root: Path) -> None:
    """A Flickr8k-layout dataset: the zoo in train (one odd file each in val and test)."""
    write_zoo(root / "imgs")
    train = [n for n in (*ODD, *BAD) if n not in ("grey.png", "plain.jpg")]
    (root / "train.txt").write_text("\n".join(train) + "\n")
    (root / "val.txt").write_text("grey.png\n")
    (root / "test.txt").write_text("plain.jpg\n")
    captions = [f"{n}#0\ta red circle on a white square" for n in (*ODD, *BAD)]
    (root / "tokens.txt").write_text("\n".join(captions) + "\n")


def test_prepare_stage_skips_each_bad_image_with_its_reason_and_keeps_odd_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.stages.prepare import main

    _flickr_layout(tmp_path / "flickr")
    params = {
        "data": {
            "source": "flickr8k",
            "root": "flickr",
            "prepared_dir": "prepared",
            "max_bad_fraction": 1.0,
            "vocab": {"min_count": 1},
            "flickr8k": {
                "images_dir": "imgs",
                "token_file": "tokens.txt",
                "train_list": "train.txt",
                "val_list": "val.txt",
                "test_list": "test.txt",
            },
        },
    }
    (tmp_path / "params.yaml").write_text(json.dumps(params))
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    status = {
        r["image_id"]: r["status"] for r in pq.read_table("prepared/images.parquet").to_pylist()
    }
    assert {_stem(n): status[_stem(n)] for n in ODD} == {_stem(n): "ok" for n in ODD}
    for name, reasons in BAD.items():
        assert reasons["check"] in status[_stem(name)].lower(), (name, status[_stem(name)])
    kept = {r["image_id"] for r in pq.read_table("prepared/captions.parquet").to_pylist()}
    assert kept == {_stem(n) for n in ODD}


# ---------------------------------------------------------------------------------- extract
def _image_table(root: Path) -> Path:
    """``data/prepared/images.parquet`` listing the zoo as status ok (as if prepare had been
    skipped or the table edited), plus rows whose path leaves the image root."""
    prepared = root / "data" / "prepared"
    write_zoo(prepared / "images")
    Image.new("RGB", (40, 40)).save(root / "outside.png")  # a real image outside the root
    (prepared / "images" / "link.png").symlink_to(root / "outside.png")
    # names relative to <prepared_dir>/images, the image root of the (default) synthetic source
    rows = [(_stem(n), n) for n in (*ODD, *BAD)]
    rows += [("dotdot", "../../../outside.png"), ("absolute", str(root / "outside.png"))]
    rows += [("symlink", "link.png")]
    table = pa.table(
        {
            "image_id": [r[0] for r in rows],
            "split": ["train"] * len(rows),
            "file": [r[1] for r in rows],
            "width": pa.array([48] * len(rows), pa.int32()),
            "height": pa.array([40] * len(rows), pa.int32()),
            "status": ["ok"] * len(rows),
        }
    ).replace_schema_metadata({"image_root": str(prepared / "images"), "source": "synthetic"})
    pq.write_table(table, prepared / "images.parquet")
    return prepared / "images.parquet"


def test_extract_stage_skips_bad_and_escaping_rows_and_extracts_every_odd_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.stages.extract import main
    from sat_model.features.store import FeatureStore

    _image_table(tmp_path)
    params = {
        "encoder": {
            "name": "random",
            "resize": 36,
            "crop": 32,
            "batch_size": 3,
            "num_workers": 0,
            "torch_threads": 1,
        }
    }
    (tmp_path / "params.yaml").write_text(json.dumps(params))
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    assert sorted(FeatureStore("data/features/train.arrow").ids) == sorted(_stem(n) for n in ODD)
    report = json.loads(Path("data/features/extract_report.json").read_text())
    reasons = {s["item"]: s["reason"].lower() for s in report["skipped"]}
    for name, expected in BAD.items():
        assert expected["decode"] in reasons[_stem(name)], (name, reasons[_stem(name)])
    for image_id in ("dotdot", "absolute", "symlink"):
        assert "escapes the image root" in reasons[image_id]


# ------------------------------------------------------------------ sat caption and pyfunc
@pytest.fixture(scope="module")
def zoo_and_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("zoo")
    write_zoo(root / "zoo")
    return root / "zoo", write_tiny_model(root / "model", crop=32, resize=36)


def test_sat_caption_reports_each_bad_file_and_captions_every_odd_one(
    zoo_and_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from pipeline.cli.main import main

    zoo, model = zoo_and_model
    monkeypatch.chdir(tmp_path)  # no params.yaml: defaults
    names = [*ODD, *BAD]
    assert main(["caption", *(str(zoo / n) for n in names), "--model", str(model)]) == 0
    out, err = capsys.readouterr()
    captioned = {Path(line.split(": ", 1)[0]).name for line in out.strip().splitlines()}
    assert captioned == set(ODD)
    errors = {Path(line.split(": error: ")[0]).name: line.lower() for line in err.splitlines()}
    for name, expected in BAD.items():
        assert expected["decode"] in errors[name], (name, errors.get(name))


def test_sat_caption_with_only_bad_files_fails(zoo_and_model, tmp_path, monkeypatch) -> None:
    from pipeline.cli.main import main

    zoo, model = zoo_and_model
    monkeypatch.chdir(tmp_path)
    assert main(["caption", *(str(zoo / n) for n in BAD), "--model", str(model)]) == 1


@pytest.fixture(scope="module")
def pyfunc(zoo_and_model):
    from pipeline.tracking.pyfunc_model import CHECKPOINT_ARTIFACT, SatCaptionerModel

    model = SatCaptionerModel()
    context = types.SimpleNamespace(artifacts={CHECKPOINT_ARTIFACT: str(zoo_and_model[1])})
    model.load_context(context)
    return model


def test_pyfunc_predict_answers_each_row_caption_or_reason(zoo_and_model, pyfunc) -> None:
    import base64

    import pandas as pd

    zoo, _ = zoo_and_model
    present = [n for n in (*ODD, *BAD) if (zoo / n).exists()]
    rows = [(zoo / n).read_bytes() for n in present]  # raw bytes, as a Python client sends
    rows.append(base64.b64encode((zoo / "text.jpg").read_bytes()).decode())  # base64 non-image
    rows.append("definitely not base64 !!")
    out = pyfunc.predict(None, pd.DataFrame({"image": rows}))
    assert len(out) == len(rows)
    served_reasons = {  # what a client is told: nothing about files, no decoder's text
        "empty.jpg": "empty image data",
        "truncated.jpg": "truncated or corrupt image data",
        "text.jpg": "not a recognised image",
        "bomb.png": "decompression bomb guard",
        "b64text": "not a recognised image",
        "junk": "not an image: expected base64 or a data: URL",
    }
    for i, name in enumerate([*present, "b64text", "junk"]):
        row = out.iloc[i]
        if name in ODD:
            assert pd.isna(row["error"]) and row["caption"], name
        else:
            assert pd.isna(row["caption"]), name
            assert row["error"].startswith(f"row {i}: {served_reasons[name]}"), row["error"]


def test_pyfunc_request_with_no_usable_image_is_an_invalid_parameter(pyfunc) -> None:
    import pandas as pd
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="no usable image in the request: row 0") as info:
        pyfunc.predict(None, pd.DataFrame({"image": [b"", "not an image"]}))
    assert info.value.error_code == "INVALID_PARAMETER_VALUE"


# --------------------------------------------------------------- whole-run inputs: checkpoints
class _RunsCode:
    """Unpickling this object would call ``Path.touch(marker)``: code execution from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _damage(model: Path, how: str, marker: Path) -> str:
    """Damage the checkpoint folder ``model``; return the words its error must contain."""
    if how == "pickled code":  # a format-1 folder (model.pt, before safetensors) that runs code
        (model / "model.safetensors").unlink()
        torch.save({"format_version": 1, "model_state": _RunsCode(marker)}, model / "model.pt")
        return "refusing to unpickle code"
    if how == "corrupted":
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[: len(data) // 2])
        return "corrupted"
    other = Vocab(("<pad>", "<start>", "<end>", "<unk>", "a", "blue", "square"), 1, 100, 20)
    (model / "vocab.json").write_text(
        json.dumps(
            {
                "format_version": 1,
                "itos": list(other.itos),
                "min_count": 1,
                "max_size": 100,
                "max_caption_length": 20,
            }
        )
    )
    return "vocab"


@pytest.mark.parametrize("how", ["pickled code", "corrupted", "another vocabulary"])
def test_sat_caption_refuses_a_bad_checkpoint_and_runs_no_code(
    zoo_and_model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
) -> None:
    from pipeline.cli.main import main

    zoo, model = zoo_and_model
    copy = Path(shutil.copytree(model, tmp_path / "model"))
    marker = tmp_path / "code-ran"
    words = _damage(copy, how, marker)
    monkeypatch.chdir(tmp_path)
    # a user error: one line naming the CheckpointError's reason, exit 1, no traceback
    assert main(["caption", str(zoo / "plain.jpg"), "--model", str(copy)]) == 1
    err = capsys.readouterr().err
    assert re.search(words, err) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    with pytest.raises(CheckpointError, match=words):  # -v shows the error itself
        main(["-v", "caption", str(zoo / "plain.jpg"), "--model", str(copy)])
    assert not marker.exists()


# ---------------------------------------------------------- whole-run inputs: feature store
def test_training_on_a_truncated_feature_store_names_the_file(
    tiny_project: Path, tmp_path: Path
) -> None:
    from pipeline.settings import load_params
    from sat_model.features.store import FeatureStoreError
    from sat_model.train.run import TrainFolders, Worker, train_model

    # inputs only: other tests may already have trained into the shared project's models/
    keep_inputs = shutil.ignore_patterns("models", "mlflow.db", "mlartifacts", "ray_results")
    project = Path(shutil.copytree(tiny_project, tmp_path / "p", ignore=keep_inputs))
    store = project / "data" / "features" / "train.arrow"
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 2])
    params = load_params(project / "params.yaml")
    with pytest.raises(FeatureStoreError, match=r"train\.arrow"):
        train_model(
            params,
            "soft",
            TrainFolders(
                project / "data" / "prepared", project / "data" / "features", project / "models"
            ),
            worker=Worker(device="cpu"),
        )
    assert not (project / "models" / "soft" / "model.safetensors").exists()


# ----------------------------------------------------------------------- params, every stage
STAGES = ["prepare", "extract", "train", "evaluate", "register", "tune"]
BAD_PARAMS = {
    "unknown key": ("encoder.bogus_key=1", "encoder.bogus_key"),
    "wrong type": ("encoder.batch_size=many", "encoder.batch_size"),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_every_stage_refuses_bad_params_naming_the_key_before_any_work(
    stage: str, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import importlib

    main = importlib.import_module(f"pipeline.stages.{stage}").main
    override, key = BAD_PARAMS[case]
    (tmp_path / "params.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    argv = ["--params", "params.yaml", "-S", override]
    if stage in ("train", "evaluate"):
        argv += ["--attention", "soft"]
    with pytest.raises(SystemExit) as exited:  # `<stage>: error: ...` on stderr, no traceback
        main(argv)
    assert exited.value.code == 1
    message = capsys.readouterr().err
    assert message.startswith(f"{stage}: error: invalid params:")
    assert key in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing written
