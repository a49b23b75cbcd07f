"""Source readers: each parses its format into the same records, keeping every problem."""

import json
from pathlib import Path

import pytest

from sat_model.config import DataConfig
from sat_model.data.sources import EXCLUDED, LEAVES_FOLDER, OK, SourceError, read_source
from sat_model.data.sources.coco import CocoConfig, read_coco
from sat_model.data.sources.flickr8k import read_flickr8k
from sat_model.data.sources.karpathy import read_karpathy
from sat_model.data.sources.synthetic import SyntheticConfig, read_synthetic
from sat_model.data.text import tokenize
from sat_model.paths import shared_data

SAMPLE = shared_data("flickr8k-sample")
needs_sample = pytest.mark.skipif(
    not (SAMPLE / "dataset_flickr8k.json").is_file(),
    reason=f"shared Flickr8k sample not found at {SAMPLE}",
)


def write_flickr8k(root: Path, tokens: bytes, train: str, val: str = "", test: str = "") -> dict:
    (root / "Flickr8k_text").mkdir(parents=True)
    (root / "Flickr8k_text/Flickr8k.token.txt").write_bytes(tokens)
    lists = {}
    for split, text in {"train": train, "val": val, "test": test}.items():
        rel = f"Flickr8k_text/{split}.txt"
        (root / rel).write_text(text)
        lists[split] = rel
    return lists


def test_read_flickr8k_attaches_captions_to_listed_images(tmp_path: Path) -> None:
    tokens = b"a.jpg#0\tA dog .\na.jpg#1\tA brown dog\nb.jpg#0\tA cat\n"
    lists = write_flickr8k(tmp_path, tokens, train="a.jpg\n", val="b.jpg\n")
    src = read_flickr8k(tmp_path, "imgs", "Flickr8k_text/Flickr8k.token.txt", lists)
    assert [(i.image_id, i.split, i.file, i.status) for i in src.images] == [
        ("a", "train", "a.jpg", OK),
        ("b", "val", "b.jpg", OK),
    ]
    assert [(c.image_id, c.raw) for c in src.captions] == [
        ("a", "A dog ."),
        ("a", "A brown dog"),
        ("b", "A cat"),
    ]
    assert src.image_root == (tmp_path / "imgs").resolve()
    assert src.skipped == ()


def test_read_flickr8k_keeps_bad_lines_as_skips_with_reasons(tmp_path: Path) -> None:
    tokens = (
        b"a.jpg#0\tgood\n"
        b"a.jpg#1\tcaf\xe9 latin-1\n"  # not UTF-8
        b"no tab here\n"
        b"\n"  # blank lines are not items
        b"c.jpg#0\tin no split\n"
    )
    lists = write_flickr8k(tmp_path, tokens, train="a.jpg\na.jpg\n", val="a.jpg\n")
    src = read_flickr8k(tmp_path, "imgs", "Flickr8k_text/Flickr8k.token.txt", lists)
    reasons = {s.item: s.reason for s in src.skipped}
    assert reasons == {
        "Flickr8k.token.txt line 2": "line is not UTF-8",
        "Flickr8k.token.txt line 3": "malformed line: expected '<image>#<n><TAB><caption>'",
        "Flickr8k.token.txt line 5": "image skipped: image is in no split",
    }
    statuses = [(i.image_id, i.split, i.status.split(" (")[0]) for i in src.images]
    assert statuses == [
        ("a", "train", OK),
        ("a", "train", "duplicate image id 'a'"),
        ("a", "val", "duplicate image id 'a'"),
        ("c", None, "image is in no split"),
    ]
    assert [c.raw for c in src.captions] == ["good"]


def test_read_flickr8k_names_a_missing_token_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"token file .*missing\.txt"):
        read_flickr8k(tmp_path, "imgs", "missing.txt", {})


def karpathy_entry(name: str, split: str, raws: list[str], **extra: object) -> dict:
    return {"filename": name, "split": split, "sentences": [{"raw": r} for r in raws], **extra}


def test_read_karpathy_folds_restval_into_train_when_asked(tmp_path: Path) -> None:
    data = {
        "images": [
            karpathy_entry("a.jpg", "train", ["x"], filepath="train2014", cocoid=11),
            karpathy_entry("b.jpg", "restval", ["y"], filepath="val2014", cocoid=12),
            karpathy_entry("c.jpg", "test", ["z"], filepath="val2014", cocoid=13),
        ]
    }
    (tmp_path / "k.json").write_text(json.dumps(data))
    folded = read_karpathy(tmp_path, "k.json", "imgs", restval_to_train=True)
    assert [(i.image_id, i.split, i.file, i.status) for i in folded.images] == [
        ("11", "train", "train2014/a.jpg", OK),
        ("12", "train", "val2014/b.jpg", OK),
        ("13", "test", "val2014/c.jpg", OK),
    ]
    dropped = read_karpathy(tmp_path, "k.json", "imgs", restval_to_train=False)
    assert dropped.images[1].split is None
    assert dropped.images[1].status.startswith(EXCLUDED)


def test_read_karpathy_marks_unknown_split_and_missing_raw(tmp_path: Path) -> None:
    data = {
        "images": [
            karpathy_entry("a.jpg", "holdout", ["x"]),
            {"filename": "b.jpg", "split": "val", "sentences": [{"tokens": ["y"]}]},
        ]
    }
    (tmp_path / "k.json").write_text(json.dumps(data))
    src = read_karpathy(tmp_path, "k.json", "imgs", restval_to_train=True)
    assert src.images[0].status == "image is in no split (split 'holdout')"
    assert [s.reason for s in src.skipped] == [
        "image skipped: image is in no split (split 'holdout')",
        "sentence has no raw text",
    ]


def test_read_karpathy_names_a_file_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text("{oops")
    with pytest.raises(SourceError, match="not valid JSON"):
        read_karpathy(tmp_path, "k.json", "imgs", restval_to_train=True)


def coco_file(ids: list[int], captions_per_image: int = 1) -> dict:
    return {
        "images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in ids],
        "annotations": [
            {"id": 100 * i + j, "image_id": i, "caption": f"caption {j} of {i}"}
            for i in ids
            for j in range(captions_per_image)
        ],
    }


def write_coco(root: Path, train: dict, val: dict) -> tuple[str, str]:
    (root / "annotations").mkdir()
    (root / "annotations/train.json").write_text(json.dumps(train))
    (root / "annotations/val.json").write_text(json.dumps(val))
    return ("annotations/train.json", "annotations/val.json")


def test_read_coco_draws_val_and_test_from_the_held_out_file(tmp_path: Path) -> None:
    files = write_coco(tmp_path, coco_file([1, 2, 3]), coco_file(list(range(10, 20))))
    src = read_coco(tmp_path, CocoConfig(annotation_files=files, images_dirs=("train2014", "val2014"), val_images=3, test_images=4, seed=0, max_captions_per_image=5, restval_to_train=True))
    split = {i.image_id: i.split for i in src.images}
    assert [split[k] for k in ("1", "2", "3")] == ["train"] * 3
    held = [split[str(k)] for k in range(10, 20)]
    assert (held.count("val"), held.count("test"), held.count("train")) == (3, 4, 3)
    assert src.images[0].file == "train2014/000000000001.jpg"
    again = read_coco(tmp_path, CocoConfig(annotation_files=files, images_dirs=("train2014", "val2014"), val_images=3, test_images=4, seed=0, max_captions_per_image=5, restval_to_train=True))
    assert again == src  # the seed fixes the draw


def test_read_coco_leaves_out_the_rest_when_not_training_on_it(tmp_path: Path) -> None:
    files = write_coco(tmp_path, coco_file([1]), coco_file(list(range(10, 20))))
    src = read_coco(tmp_path, CocoConfig(annotation_files=files, images_dirs=("t", "v"), val_images=3, test_images=4, seed=0, max_captions_per_image=5, restval_to_train=False))
    rest = [i for i in src.images if i.split is None]
    assert len(rest) == 3
    assert all(i.status.startswith(EXCLUDED) for i in rest)


def test_read_coco_truncates_captions_and_skips_unknown_images(tmp_path: Path) -> None:
    train = coco_file([1], captions_per_image=7)
    train["annotations"].append({"id": 999, "image_id": 42, "caption": "orphan"})
    files = write_coco(tmp_path, train, coco_file([10]))
    src = read_coco(tmp_path, CocoConfig(annotation_files=files, images_dirs=("t", "v"), val_images=1, test_images=0, seed=0, max_captions_per_image=5, restval_to_train=True))
    assert [c.raw for c in src.captions if c.image_id == "1"] == [
        f"caption {j} of 1" for j in range(5)
    ]
    reasons = sorted(s.reason for s in src.skipped)
    assert reasons[-1] == "image id 42 is not in the images list"
    assert reasons[:2] == [f"{EXCLUDED}: beyond coco.max_captions_per_image=5"] * 2


def test_read_synthetic_records_boxes_and_png_files(tmp_path: Path) -> None:
    sizes = SyntheticConfig(train_images=2, val_images=1, test_images=1, captions_per_image=5)
    src = read_synthetic(tmp_path / "images", sizes, workers=1)
    assert [(i.image_id, i.split, i.file) for i in src.images] == [
        ("train_00000", "train", "train_00000.png"),
        ("train_00001", "train", "train_00001.png"),
        ("val_00000", "val", "val_00000.png"),
        ("test_00000", "test", "test_00000.png"),
    ]
    assert all((src.image_root / i.file).is_file() and i.boxes for i in src.images)
    assert len(src.captions) == 4 * 5
    box = src.images[0].boxes[0]
    assert box.label == f"{box.size} {box.colour} {box.shape}" and box.x0 < box.x1


def test_read_source_rejects_a_root_that_is_not_a_folder(tmp_path: Path) -> None:
    data = DataConfig(source="karpathy", root="nowhere")
    with pytest.raises(SourceError, match="nowhere"):
        read_source(data, tmp_path / "out", tmp_path)


@pytest.mark.slow
@needs_sample
def test_flickr8k_and_karpathy_readers_agree_on_the_shared_sample() -> None:
    raw = read_flickr8k(
        SAMPLE,
        "Flickr8k_Dataset",
        "Flickr8k_text/Flickr8k.token.txt",
        {
            "train": "Flickr8k_text/Flickr_8k.trainImages.txt",
            "val": "Flickr8k_text/Flickr_8k.devImages.txt",
        },
    )
    kar = read_karpathy(SAMPLE, "dataset_flickr8k.json", "Flickr8k_Dataset", restval_to_train=True)
    assert raw.image_root == kar.image_root
    images = lambda s: sorted((i.image_id, i.split, i.file, i.status) for i in s.images)  # noqa: E731
    assert images(raw) == images(kar)
    assert len(raw.images) == 2250
    assert sum(i.split == "train" for i in raw.images) == 2000
    # same captions per image in the same order; Karpathy's own tokens equal ours (test_text)
    by_image = lambda s: {  # noqa: E731
        i: [tokenize(c.raw) for c in s.captions if c.image_id == i]
        for i in {c.image_id for c in s.captions}
    }
    assert by_image(raw) == by_image(kar)
    assert raw.skipped == kar.skipped == ()


def test_an_unsafe_name_never_shadows_a_valid_image_with_the_same_id(tmp_path: Path) -> None:
    tokens = b"../a.jpg#0\toutside caption\na.jpg#0\tgood caption\n"
    lists = write_flickr8k(tmp_path, tokens, train="../a.jpg\na.jpg\n")
    src = read_flickr8k(tmp_path, "imgs", "Flickr8k_text/Flickr8k.token.txt", lists)
    assert [(i.image_id, i.file, i.status) for i in src.images] == [
        ("a", "../a.jpg", LEAVES_FOLDER),
        ("a", "a.jpg", OK),
    ]
    assert [c.raw for c in src.captions] == ["good caption"]
    assert [s.reason for s in src.skipped] == [f"image skipped: {LEAVES_FOLDER}"]
