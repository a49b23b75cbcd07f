"""A dataset not in place: one line naming what is missing, where the files are distributed (the
addresses the datasets guide gives) and where they go; nothing read before it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.settings import load_params
from sat_model.config import DataConfig
from sat_model.data.datasets import GUIDE, missing_dataset
from sat_model.data.sources import SourceError, dataset_missing, read_source, source_settings
from tests.factories import ROOT

URL = re.compile(r"https?://[^\s,;)]+")
PROFILES = ("flickr8k", "flickr30k", "coco")



def _missing(data: DataConfig, root: Path) -> str:
    return missing_dataset(data, root, source_settings(data))

def _profile_data(name: str, **changes: object) -> DataConfig:
    data = load_params(ROOT / "profiles" / name / "params.yaml").data
    return data.model_copy(update=changes)


@pytest.mark.parametrize("name", PROFILES)
def test_a_profiles_absent_dataset_is_one_line_with_the_guides_addresses_and_its_folder(
    tmp_path: Path, name: str
) -> None:
    data = _profile_data(name)
    root = tmp_path / "datasets" / name
    line = _missing(data, root)
    assert "\n" not in line and f"data.root {root} is not a folder" in line
    urls = URL.findall(line)
    assert urls, line  # where to get it
    guide = (ROOT / GUIDE).read_text(encoding="utf-8")
    assert [u for u in urls if u not in guide] == []  # the page says the same
    # where to put it: what the source's reader opens, relative to data.root
    assert "put " in line and " there" in line and GUIDE in line


def test_the_flickr8k_line_lists_the_files_the_reader_opens() -> None:
    data = _profile_data("flickr8k")
    line = _missing(data, Path("/nowhere/datasets/flickr8k"))
    for rel in (
        f"{data.flickr8k.images_dir}/",
        data.flickr8k.token_file,
        data.flickr8k.train_list,
        data.flickr8k.val_list,
    ):
        assert rel in line
    assert "Flickr8k_Dataset.zip" in line and "Flickr8k_text.zip" in line


def test_the_karpathy_split_of_coco_names_karpathys_zip_and_cocos_photos(tmp_path: Path) -> None:
    line = _missing(_profile_data("coco", source="karpathy"), tmp_path / "coco")
    assert line.startswith("MS COCO 2014: ")
    assert "dataset_coco.json" in line and "caption_datasets.zip" in line
    assert "https://cocodataset.org/#download" in line


def _flickr8k_layout(root: Path, images: str = "Flickr8k_Dataset") -> None:
    (root / images).mkdir(parents=True)
    (root / "Flickr8k_text").mkdir()
    for name in ("Flickr8k.token.txt", "Flickr_8k.trainImages.txt", "Flickr_8k.devImages.txt"):
        (root / "Flickr8k_text" / name).write_text("")


def test_a_part_missing_is_named_with_the_near_name_found_instead(tmp_path: Path) -> None:
    # the distributed zip unpacks to Flicker8k_Dataset/
    _flickr8k_layout(tmp_path, images="Flicker8k_Dataset")
    (tmp_path / "Flickr8k_text" / "Flickr_8k.devImages.txt").unlink()
    line = _missing(_profile_data("flickr8k"), tmp_path)
    assert "lacks Flickr8k_Dataset/ (found Flicker8k_Dataset: rename it), " in line
    assert "Flickr8k_text/Flickr_8k.devImages.txt. Get " in line  # the other one missing


def test_the_layout_in_place_is_nothing_missing_and_a_split_not_required_needs_no_list(
    tmp_path: Path,
) -> None:
    _flickr8k_layout(tmp_path)  # no Flickr_8k.testImages.txt: our copy holds none
    assert _missing(_profile_data("flickr8k"), tmp_path) == ""  # train and val
    with_test = _profile_data("flickr8k", required_splits=("train", "val", "test"))
    assert "lacks Flickr8k_text/Flickr_8k.testImages.txt. " in _missing(with_test, tmp_path)


def test_read_source_refuses_before_reading_and_the_generated_scenes_need_no_folder(
    tmp_path: Path,
) -> None:
    data = _profile_data("flickr8k", root=str(tmp_path / "absent"))
    with pytest.raises(SourceError, match=r"^Flickr8k: data\.root .*absent is not a folder"):
        read_source(data, tmp_path / "out", tmp_path)
    assert dataset_missing(DataConfig(root=str(tmp_path / "absent")), tmp_path) == ""


def test_your_own_folder_is_pointed_at_not_downloaded(tmp_path: Path) -> None:
    data = DataConfig(source="folder", root="photos")
    line = dataset_missing(data, tmp_path)
    assert line.startswith(f"your own data: data.root {tmp_path / 'photos'} is not a folder")
    assert "Point data.root at your photos' folder and data.folder.captions_file at " in line
    assert not URL.search(line)
