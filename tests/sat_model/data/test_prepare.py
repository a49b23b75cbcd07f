"""The prepare stage: every bad input skipped with its reason, valid items kept, same schemas
for all four sources, byte-identical re-runs, and a loud failure only when data is unusable."""

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sat_model.config import DataConfig
from sat_model.data.prepare import REPORT_KEYS, PrepareError, check_image, prepare_dataset
from sat_model.data.scenes import generate_scene
from sat_model.data.tables import CAPTIONS_SCHEMA, IMAGES_SCHEMA, Box
from sat_model.data.text import tokenize
from sat_model.evaluation.grounding import ground_tokens
from sat_model.paths import shared_data

OUTPUTS = ("images.parquet", "captions.parquet", "vocab.json", "prepare_report.json")


def png(path: Path, size: int = 32, value: int = 90) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (value, 2 * value % 256, 30)).save(path)


def jpeg_bytes(size: int = 64) -> bytes:
    noise = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def flickr8k_config(root: Path, **data: object) -> DataConfig:
    return DataConfig(
        source="flickr8k",
        root=str(root),
        prepared_dir=str(root.parent / "prepared"),
        flickr8k={
            "images_dir": "imgs",
            "token_file": "tokens.txt",
            "train_list": "train.txt",
            "val_list": "val.txt",
            "test_list": "test.txt",
        },
        vocab={"min_count": 1, "max_caption_length": 10},
        **data,
    )


def write_bad_dataset(root: Path) -> None:
    imgs = root / "imgs"
    for name in ("good1", "good2", "good3", "good4", "nosplit"):
        png(imgs / f"{name}.png")
    png(imgs / "huge.png", size=200)
    png(root.parent / "outside.png")  # a real image outside the dataset folder
    (imgs / "empty.jpg").write_bytes(b"")
    (imgs / "trunc.jpg").write_bytes(jpeg_bytes()[:1500])
    (imgs / "text.jpg").write_text("this is not an image\n")
    train = [
        "good1.png",
        "good2.png",
        "good3.png",
        "empty.jpg",
        "trunc.jpg",
        "text.jpg",
        "missing.jpg",
        "huge.png",
        "../outside.png",
        str(root.parent / "outside.png"),
        "good1.png",
    ]
    (root / "train.txt").write_text("\n".join(train) + "\n")
    (root / "val.txt").write_text("good4.png\n")
    (root / "test.txt").write_text("")
    lines = [b"%s#0\ta caption for %s" % (n.encode(), n.encode()) for n in train[:9]]
    lines += [
        b"good1.png#1\ta red circle",
        b"good1.png#2\ta caf\xe9 in latin-1",  # not UTF-8
        b"good2.png#1\t   ",  # empty
        b"good2.png#2\t. , !",  # nothing left after tokenising
        b"good3.png#1\t" + b" ".join([b"word"] * 11),  # 11 tokens > max_caption_length 10
        b"good4.png#0\ta val caption with valword",
        b"nosplit.png#0\tan image in no split",
        str(root.parent / "outside.png#0\tabsolute").encode(),
    ]
    (root / "tokens.txt").write_bytes(b"\n".join(lines) + b"\n")


@pytest.fixture
def bad_dataset(tmp_path: Path) -> Path:
    root = tmp_path / "flickr"
    write_bad_dataset(root)
    return root


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _assert_the_report_counts_and_gives_every_reason(out: Path) -> None:
    """prepare_report.json names each skipped caption's reason and counts what was kept."""
    report = json.loads((out / "prepare_report.json").read_text())
    reasons = [s["reason"] for s in report["skipped"]]
    for expected in (
        "line is not UTF-8",
        "empty caption",
        "caption longer than max_caption_length 10",
    ):
        assert any(r.startswith(expected) for r in reasons), expected
    assert sum(r == "empty caption" for r in reasons) == 2
    # by hand: 13 image rows, 4 usable; 17 caption lines, 5 kept; train words: a caption for
    # good1 good2 good3 png red circle (9) + 4 specials
    assert {k: report[k] for k in REPORT_KEYS} == {
        "images_total": 13,
        "images_ok": 4,
        "images_skipped": 9,
        "captions_total": 17,
        "captions_kept": 5,
        "captions_skipped": 12,
        "vocab_size": 4 + 9,
        "images_train": 3,
        "images_val": 1,
        "images_test": 0,
    }


def test_every_bad_input_is_skipped_with_its_reason_and_valid_items_are_kept(
    bad_dataset: Path,
) -> None:
    cfg = flickr8k_config(
        bad_dataset,
        required_splits=("train", "val"),
        max_bad_fraction=1.0,
        max_image_pixels=100 * 100,
    )
    result = prepare_dataset(cfg)
    out = result.prepared_dir
    status = {
        (r["file"], r["status"].split(" (")[0].split(":")[0])
        for r in read_rows(out / "images.parquet")
    }
    outside = str(bad_dataset.parent / "outside.png")
    assert status == {
        ("good1.png", "ok"),
        ("good2.png", "ok"),
        ("good3.png", "ok"),
        ("good4.png", "ok"),
        ("empty.jpg", "empty file"),
        ("trunc.jpg", "corrupt or truncated image"),
        ("text.jpg", "not a readable image"),
        ("missing.jpg", "missing image file"),
        ("huge.png", "too many pixels"),
        ("../outside.png", "file name leaves the dataset folder"),
        (outside, "file name leaves the dataset folder"),
        ("good1.png", "duplicate image id 'good1'"),
        ("nosplit.png", "image is in no split"),
    }
    captions = read_rows(out / "captions.parquet")
    assert [(c["image_id"], c["caption_index"], c["tokens"]) for c in captions] == [
        ("good1", 0, ["a", "caption", "for", "good1", "png"]),
        ("good1", 1, ["a", "red", "circle"]),
        ("good2", 0, ["a", "caption", "for", "good2", "png"]),
        ("good3", 0, ["a", "caption", "for", "good3", "png"]),
        ("good4", 0, ["a", "val", "caption", "with", "valword"]),
    ]
    assert {c["split"] for c in captions if c["image_id"] == "good4"} == {"val"}
    _assert_the_report_counts_and_gives_every_reason(out)


def test_vocab_is_built_from_train_captions_only(bad_dataset: Path) -> None:
    cfg = flickr8k_config(bad_dataset, required_splits=("train",), max_bad_fraction=1.0)
    vocab = prepare_dataset(cfg).vocab
    assert "circle" in vocab.stoi and "valword" not in vocab.stoi


def test_too_many_bad_items_fail_with_the_share_and_the_reasons(bad_dataset: Path) -> None:
    cfg = flickr8k_config(bad_dataset, required_splits=("train",), max_bad_fraction=0.5)
    with pytest.raises(
        PrepareError, match=r"8 of 13 images are bad .*'file name leaves the dataset folder', 2"
    ):
        prepare_dataset(cfg)
    assert not (bad_dataset.parent / "prepared").exists()  # nothing half-written


def test_an_empty_required_split_fails_naming_the_split(bad_dataset: Path) -> None:
    cfg = flickr8k_config(bad_dataset, max_bad_fraction=1.0)  # requires test, which is empty
    with pytest.raises(PrepareError, match=r"\['test'\] have no usable image"):
        prepare_dataset(cfg)


def test_without_verify_images_a_truncated_jpeg_is_not_decoded(tmp_path: Path) -> None:
    path = tmp_path / "trunc.jpg"
    path.write_bytes(jpeg_bytes()[:1500])
    assert check_image(path, verify=False, max_pixels=10**6).status == "ok"
    assert check_image(path, verify=True, max_pixels=10**6).status.startswith(
        "corrupt or truncated"
    )
    assert check_image(path, verify=True, max_pixels=10**6).width == 64


def test_rerunning_gives_byte_identical_outputs(bad_dataset: Path) -> None:
    cfg = flickr8k_config(bad_dataset, required_splits=("train",), max_bad_fraction=1.0)
    out = prepare_dataset(cfg).prepared_dir
    first = {f: (out / f).read_bytes() for f in OUTPUTS}
    prepare_dataset(cfg)
    assert {f: (out / f).read_bytes() for f in OUTPUTS} == first
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)  # no temp files left


# ------------------------------------------------------------ one schema for four sources
def tiny_real_dataset(root: Path) -> None:
    """Four PNGs described in all three real formats (Flickr8k, Karpathy, COCO)."""
    names = {"train": ["t1.png", "t2.png"], "val": ["v1.png"], "test": ["s1.png"]}
    all_files = [n for files in names.values() for n in files]
    for i, n in enumerate(all_files):
        png(root / "imgs" / n, value=40 * i)
        png(root / "coco" / "train2014" / n, value=40 * i)
        png(root / "coco" / "val2014" / n, value=40 * i)
    for split, files in names.items():
        (root / f"{split}.txt").write_text("\n".join(files) + "\n")
    (root / "tokens.txt").write_text("".join(f"{n}#0\tA shape, {n}!\n" for n in all_files))
    karpathy = [
        {"filename": n, "split": s, "sentences": [{"raw": f"A shape, {n}!"}]}
        for s, files in names.items()
        for n in files
    ]
    (root / "k.json").write_text(json.dumps({"images": karpathy}))
    for k, (sub, files) in enumerate(
        {"train2014": names["train"], "val2014": names["val"] + names["test"]}.items()
    ):
        d = {
            "images": [{"id": 10 * k + j, "file_name": n} for j, n in enumerate(files)],
            "annotations": [
                {"id": j, "image_id": 10 * k + j, "caption": f"A shape {n}"}
                for j, n in enumerate(files)
            ],
        }
        (root / "coco" / f"{sub}.json").write_text(json.dumps(d))


def source_configs(tmp_path: Path) -> dict[str, DataConfig]:
    root = str(tmp_path / "real")
    common = {"vocab": {"min_count": 1}}
    return {
        "synthetic": DataConfig(
            prepared_dir=str(tmp_path / "synthetic"),
            synthetic={"train_images": 3, "val_images": 2, "test_images": 2},
            **common,
        ),
        "flickr8k": DataConfig(
            source="flickr8k",
            root=root,
            prepared_dir=str(tmp_path / "flickr8k"),
            flickr8k={
                "images_dir": "imgs",
                "token_file": "tokens.txt",
                "train_list": "train.txt",
                "val_list": "val.txt",
                "test_list": "test.txt",
            },
            **common,
        ),
        "karpathy": DataConfig(
            source="karpathy",
            root=root,
            prepared_dir=str(tmp_path / "karpathy"),
            karpathy={"json_file": "k.json", "images_dir": "imgs"},
            **common,
        ),
        "coco": DataConfig(
            source="coco",
            root=str(tmp_path / "real/coco"),
            prepared_dir=str(tmp_path / "coco"),
            coco={
                "annotation_files": ("train2014.json", "val2014.json"),
                "images_dirs": ("train2014", "val2014"),
                "val_images": 1,
                "test_images": 1,
            },
            **common,
        ),
    }


def test_all_four_sources_write_the_same_table_schemas_and_report_keys(tmp_path: Path) -> None:
    tiny_real_dataset(tmp_path / "real")
    for source, cfg in source_configs(tmp_path).items():
        out = prepare_dataset(cfg, workers=1).prepared_dir
        images, captions = (
            pq.read_table(out / "images.parquet"),
            pq.read_table(out / "captions.parquet"),
        )
        assert images.schema.remove_metadata() == IMAGES_SCHEMA, source
        assert captions.schema.remove_metadata() == CAPTIONS_SCHEMA, source
        meta = {k.decode(): v.decode() for k, v in images.schema.metadata.items()}
        assert meta["source"] == source
        root = out / meta["image_root"]  # relative to the table's folder
        assert not Path(meta["image_root"]).is_absolute()
        assert all((root / f).is_file() for f in images.column("file").to_pylist()), source
        report = json.loads((out / "prepare_report.json").read_text())
        assert set(REPORT_KEYS) | {"skipped"} == set(report), source
        assert report["images_ok"] == report["images_total"] > 0, (source, report["skipped"])
        vocab = json.loads((out / "vocab.json").read_text())
        assert vocab["itos"][:4] == ["<pad>", "<start>", "<end>", "<unk>"]


def test_synthetic_images_table_records_each_scene_boxes_and_size(tmp_path: Path) -> None:
    cfg = DataConfig(
        prepared_dir=str(tmp_path / "p"),
        synthetic={"seed": 3, "train_images": 2, "val_images": 1, "test_images": 1},
    )
    out = prepare_dataset(cfg, workers=1).prepared_dir
    rows = {r["image_id"]: r for r in read_rows(out / "images.parquet")}
    scene = generate_scene(3, "val", 0)
    row = rows["val_00000"]
    assert (row["split"], row["width"], row["height"], row["status"]) == ("val", 224, 224, "ok")
    assert [b["label"] for b in row["boxes"]] == [o.label for o in scene.objects]
    assert np.allclose(
        [[b["x0"], b["y0"], b["x1"], b["y1"]] for b in row["boxes"]], [o.box for o in scene.objects]
    )
    caps = [c["raw"] for c in read_rows(out / "captions.parquet") if c["image_id"] == "val_00000"]
    assert caps == list(scene.captions)
    assert (out / "images" / "val_00000.png").is_file()


def test_a_symlink_out_of_the_dataset_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "flickr"
    png(root / "imgs/ok.png")
    png(tmp_path / "outside.png")
    (root / "imgs/link.png").symlink_to(tmp_path / "outside.png")
    (root / "train.txt").write_text("ok.png\nlink.png\n")
    (root / "tokens.txt").write_text("ok.png#0\ta caption\nlink.png#0\ta caption\n")
    cfg = flickr8k_config(root, required_splits=("train",), max_bad_fraction=1.0)
    out = prepare_dataset(cfg).prepared_dir
    status = {r["file"]: r["status"] for r in read_rows(out / "images.parquet")}
    assert status == {"ok.png": "ok", "link.png": "file name leaves the dataset folder"}


def test_objects_rebuilt_from_the_boxes_column_ground_like_the_scene(tmp_path: Path) -> None:
    cfg = DataConfig(
        prepared_dir=str(tmp_path / "p"),
        synthetic={"seed": 4, "train_images": 6, "val_images": 1, "test_images": 1},
    )
    out = prepare_dataset(cfg, workers=1).prepared_dir
    for row in read_rows(out / "images.parquet"):
        split, index = row["image_id"].split("_")
        scene = generate_scene(4, split, int(index))
        rebuilt = [Box.from_row(b) for b in row["boxes"]]
        for caption in scene.captions:
            tokens = tokenize(caption)
            assert ground_tokens(tokens, rebuilt) == ground_tokens(tokens, scene.objects)
        boxes = [(b.x0, b.y0, b.x1, b.y1) for b in rebuilt]
        assert np.allclose(boxes, [o.box for o in scene.objects])


SAMPLE = shared_data("flickr8k-sample")


@pytest.mark.slow
@pytest.mark.skipif(not SAMPLE.is_dir(), reason=f"shared Flickr8k sample not found at {SAMPLE}")
def test_flickr8k_and_karpathy_prepare_identical_tables_from_the_sample(tmp_path: Path) -> None:
    tables = {}
    for source in ("flickr8k", "karpathy"):
        cfg = DataConfig(
            source=source,
            root=str(SAMPLE),
            prepared_dir=str(tmp_path / source),
            required_splits=("train", "val"),
            verify_images=False,  # file checks: other tests
        )
        out = prepare_dataset(cfg).prepared_dir
        tables[source] = (
            pq.read_table(out / "images.parquet").drop(["status"]).to_pylist(),
            pq.read_table(out / "captions.parquet").drop(["raw"]).to_pylist(),
            (out / "vocab.json").read_bytes(),
        )
    assert tables["flickr8k"] == tables["karpathy"]
    images, captions, _ = tables["flickr8k"]
    assert len(images) == 2250 and sum(r["split"] == "train" for r in images) == 2000
    assert len(captions) > 0.95 * 11_250  # all but the captions over 20 tokens


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "ICO"])
def test_a_photo_in_a_format_no_stage_opens_is_never_parsed(tmp_path: Path, fmt: str) -> None:
    """An EPS file named .jpg reached Pillow's EPS plugin (and its Ghostscript step); now only
    the formats extract and captioning open are tried, and the file is a skipped image."""
    path = tmp_path / "photo.jpg"
    if fmt == "EPS":  # Pillow reads the size from the bounding box without Ghostscript
        path.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    else:
        Image.new("RGB", (10, 10)).save(path, format=fmt)
    with Image.open(path) as image:  # a format Pillow knows: unrestricted, it would open
        assert image.format == fmt
    assert check_image(path, verify=False, max_pixels=10_000).status == "not a readable image"
