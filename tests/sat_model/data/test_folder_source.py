"""The ``folder`` source: your own photos and a captions file (CSV or JSON lines), read and then
prepared, every bad row kept out with its reason."""

import json
from pathlib import Path

import pytest
from PIL import Image

from sat_model.config import DataConfig, VocabConfig
from sat_model.data.sources.folder import FolderConfig
from sat_model.data.prepare import PrepareError, prepare_dataset
from sat_model.data.sources import LEAVES_FOLDER, OK, SourceError, image_root, read_source
from sat_model.data.sources.folder import FolderConfig, read_folder



def photo(path: Path, colour: str = "red") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), colour).save(path)


def csv_file(root: Path, text: str, name: str = "captions.csv") -> str:
    (root / name).write_text(text, encoding="utf-8")
    return name


def test_csv_with_a_split_column_gives_one_image_per_file(tmp_path: Path) -> None:
    name = csv_file(
        tmp_path,
        "File, Caption,split\n"  # a spreadsheet's header
        "a.jpg,a red car,train\n"
        './a.jpg,"a car, red",train\n'
        "sub/b.jpg,a blue boat,VAL\n",
    )
    src = read_folder(tmp_path, FolderConfig(images_dir="photos", captions_file=name, format="auto", val_images=0, test_images=0, seed=0))
    assert [(i.image_id, i.split, i.file, i.status) for i in src.images] == [
        ("a.jpg", "train", "a.jpg", OK),
        ("sub/b.jpg", "val", "sub/b.jpg", OK),
    ]
    assert [(c.image_id, c.raw, c.item) for c in src.captions] == [
        ("a.jpg", "a red car", "captions.csv line 2"),
        ("a.jpg", "a car, red", "captions.csv line 3"),
        ("sub/b.jpg", "a blue boat", "captions.csv line 4"),
    ]
    assert src.image_root == (tmp_path / "photos").resolve() and src.skipped == ()


def test_without_a_split_column_the_images_are_drawn_by_the_seed(tmp_path: Path) -> None:
    rows = "".join(f"p{i}.jpg,caption {i}\np{i}.jpg,another {i}\n" for i in range(20))
    name = csv_file(tmp_path, "file,caption\n" + rows)
    src = read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="csv", val_images=3, test_images=4, seed=0))
    splits = {i.file: i.split for i in src.images}
    assert sorted(splits.values()).count("val") == 3 and list(splits.values()).count("test") == 4
    assert list(splits.values()).count("train") == 13
    assert read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="csv", val_images=3, test_images=4, seed=0)).images == src.images
    other = {i.file: i.split for i in read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="csv", val_images=3, test_images=4, seed=1)).images}
    assert other != splits  # 20 choose 3, 4: another seed draws another split


def test_bad_rows_are_skipped_with_their_reasons(tmp_path: Path) -> None:
    name = csv_file(
        tmp_path,
        "file,caption,split\n"
        "a.jpg,a red car,train\n"  # 2
        "a.jpg,a red car,train\n"  # 3 duplicate
        "a.jpg,a red  car,train\n"  # 4 duplicate up to spaces
        "a.jpg,another,val\n"  # 5 contradicts train
        "b.jpg,a boat,holdout\n"  # 6 unknown split
        ",a caption,train\n"  # 7 no file
        "../c.jpg,outside,train\n"  # 8 leaves the folder
        "/etc/passwd,outside,train\n"  # 9 absolute
        "a.jpg,a car, red,train\n",  # 10 an unquoted comma: the split column would get ' red'
    )
    src = read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="auto", val_images=0, test_images=0, seed=0))
    reasons = {s.item: s.reason for s in src.skipped}
    assert reasons["captions.csv line 3"].startswith("duplicate row")
    assert "captions.csv line 2" in reasons["captions.csv line 3"]
    assert reasons["captions.csv line 4"].startswith("duplicate row")
    assert "contradicts 'train'" in reasons["captions.csv line 5"]
    assert "'holdout' is not train, val or test" in reasons["captions.csv line 6"]
    assert reasons["captions.csv line 7"] == "no file name"
    assert reasons["captions.csv line 8"] == f"image skipped: {LEAVES_FOLDER}"
    assert reasons["captions.csv line 9"] == f"image skipped: {LEAVES_FOLDER}"
    assert reasons["captions.csv line 10"].startswith("malformed line: more fields than")
    assert [c.item for c in src.captions] == ["captions.csv line 2"]


def test_jsonl_rows_and_malformed_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"file": "a.jpg", "caption": "a dog"}),
        "{not json",
        json.dumps(["a.jpg", "a list"]),
        json.dumps({"file": "a.jpg", "caption": 3}),
        json.dumps({"file": "b.jpg", "caption": "a cat", "extra": 1}),
    ]
    (tmp_path / "caps.jsonl").write_text("\n".join(lines) + "\n")
    src = read_folder(tmp_path, FolderConfig(images_dir=".", captions_file="caps.jsonl", format="auto", val_images=1, test_images=0, seed=0))
    assert sorted(c.raw for c in src.captions) == ["a cat", "a dog"]
    assert sorted(i.split for i in src.images if i.split) == ["train", "val"]
    assert {s.item for s in src.skipped} == {
        "caps.jsonl line 2",
        "caps.jsonl line 3",
        "caps.jsonl line 4",
    }
    assert all(s.reason.startswith("malformed line") for s in src.skipped)


@pytest.mark.parametrize(
    ("text", "message"),
    [("name,caption\na.jpg,x\n", "no column file"), ("file,text\na.jpg,x\n", "no column caption")],
)
def test_a_captions_file_without_its_columns_is_a_source_error(
    tmp_path: Path, text: str, message: str
) -> None:
    name = csv_file(tmp_path, text)
    with pytest.raises(SourceError, match=message):
        read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="auto", val_images=0, test_images=0, seed=0))


def test_a_missing_captions_file_is_a_source_error(tmp_path: Path) -> None:
    data = DataConfig(source="folder", root=str(tmp_path))
    with pytest.raises(SourceError, match="lacks captions.csv"):
        read_source(data, tmp_path / "out", tmp_path)


def folder_data(root: Path, **folder: object) -> DataConfig:
    return DataConfig(
        source="folder",
        root=str(root),
        prepared_dir=str(root / "prepared"),
        required_splits=("train", "val"),
        folder=FolderConfig(**folder),  # type: ignore[arg-type]
        vocab=VocabConfig(min_count=1),
    )


def test_prepare_keeps_every_good_row_and_names_every_bad_one(tmp_path: Path) -> None:
    colours = ["red", "green", "blue", "white", "black", "yellow"]
    for colour in colours:
        photo(tmp_path / "photos" / f"{colour}.jpg", colour)
    (tmp_path / "photos" / "broken.jpg").write_bytes(b"not a jpeg at all")
    good = [f"{c}.jpg,a {c} square,{'val' if i < 2 else 'train'}" for i, c in enumerate(colours)]
    bad = {
        "missing.jpg,a ghost,train": "missing image file",
        "broken.jpg,a broken photo,train": "not a readable image",
        "red.jpg,   ,val": "empty caption",
        "../red.jpg,a red square,train": LEAVES_FOLDER,
        "green.jpg,a green square,val": "duplicate row",
    }
    (tmp_path / "captions.csv").write_text("\n".join(["file,caption,split", *good, *bad]) + "\n")
    data = folder_data(tmp_path, images_dir="photos").model_copy(update={"max_bad_fraction": 0.5})
    report = prepare_dataset(data, base_dir=tmp_path).report
    assert (report["images_train"], report["images_val"], report["captions_kept"]) == (4, 2, 6)
    by_item = {e["item"]: e["reason"] for e in report["skipped"]}  # type: ignore[attr-defined]
    line = {row: f"captions.csv line {n}" for n, row in enumerate(bad, start=len(good) + 2)}
    for row, reason in bad.items():
        # a bad image is named by its file, a bad caption by its line
        file = row.split(",")[0]
        found = by_item.get(file) if file in by_item else by_item.get(line[row])
        assert found is not None and reason in found, f"{row!r}: {found!r}"
    assert len(by_item) == len(bad) + 1  # and the caption line of the image that leaves
    assert image_root(data, tmp_path) == (tmp_path / "photos").resolve()


def test_prepare_fails_in_one_line_when_too_much_is_bad(tmp_path: Path) -> None:
    photo(tmp_path / "a.jpg")
    photo(tmp_path / "b.jpg")
    rows = "file,caption,split\na.jpg,a photo,train\nb.jpg,a photo,val\n"
    rows += "".join(f"gone{i}.jpg,a photo,train\n" for i in range(3))
    (tmp_path / "captions.csv").write_text(rows)
    with pytest.raises(PrepareError, match=r"3 of 5 images are bad .*missing image file") as e:
        prepare_dataset(folder_data(tmp_path), base_dir=tmp_path)
    assert "\n" not in str(e.value)


def test_a_nul_byte_in_a_file_name_and_a_huge_field_skip_their_rows_only(tmp_path: Path) -> None:
    """Both crashed prepare and ``sat profile new`` (``embedded null byte`` when the file was
    checked; csv's "field larger than field limit" for the whole file)."""
    photo(tmp_path / "a.jpg")
    name = csv_file(
        tmp_path,
        "file,caption\n"
        "a.jpg,a red car\n"  # 2
        "b\x00.jpg,a nul in the name\n"  # 3
        f"c.jpg,{'x' * 200_000}\n"  # 4 over csv's 128 KiB field limit
        "a.jpg,a car that is red\n",  # 5
    )
    (tmp_path / "caps.jsonl").write_text(json.dumps({"file": "d\x00.jpg", "caption": "a dog"}))
    src = read_folder(tmp_path, FolderConfig(images_dir=".", captions_file=name, format="auto", val_images=0, test_images=0, seed=0))
    reasons = sorted(s.reason for s in src.skipped)
    assert reasons[0].startswith("malformed line: field larger than field limit"), reasons
    assert reasons[1:] == ["the file name holds a NUL byte"], reasons
    assert [c.item for c in src.captions] == ["captions.csv line 2", "captions.csv line 5"]
    jsonl = read_folder(tmp_path, FolderConfig(images_dir=".", captions_file="caps.jsonl", format="auto", val_images=0, test_images=0, seed=0))
    assert [s.reason for s in jsonl.skipped] == ["the file name holds a NUL byte"]
