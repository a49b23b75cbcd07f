"""The Flickr30k and COCO profiles on slices in their real formats, built here from shared
Flickr8k-sample photos: Karpathy's ``dataset_flickr30k.json`` and ``dataset_coco.json``, and
COCO's ``captions_train2014.json`` / ``captions_val2014.json``. Each profile's own params (only
the data root and the output folders moved to the test's folder) prepare and extract them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipeline.stages import load_context
from pipeline.stages.extract import run as extract
from pipeline.stages.prepare import run as prepare
from sat_model.features.store import FeatureStore
from sat_model.paths import shared_data
from tests.factories import ROOT

SAMPLE = shared_data("flickr8k-sample")
TOKENS = SAMPLE / "Flickr8k_text" / "Flickr8k.token.txt"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not TOKENS.is_file(), reason=f"shared Flickr8k sample not found at {SAMPLE}"
    ),
]


def _photos(n: int) -> list[tuple[Path, list[str]]]:
    """The first ``n`` sample photos and their five captions."""
    captions: dict[str, list[str]] = {}
    for line in TOKENS.read_text(encoding="utf-8").splitlines():
        name, _, caption = line.partition("\t")
        captions.setdefault(name.rpartition("#")[0], []).append(caption)
    names = sorted(captions)[:n]
    return [(SAMPLE / "Flickr8k_Dataset" / name, captions[name]) for name in names]


def _sentences(raws: list[str], imgid: int, first_sentid: int) -> list[dict[str, object]]:
    # Karpathy's tokens: lower-cased alphanumeric words
    return [
        {
            "tokens": re.findall(r"[a-z0-9]+", raw.lower()),
            "raw": raw,
            "imgid": imgid,
            "sentid": first_sentid + j,
        }
        for j, raw in enumerate(raws)
    ]


FLICKR30K_SPLITS = ["train"] * 6 + ["val"] * 2 + ["test"] * 2


def flickr30k_slice(root: Path) -> dict[str, list[str]]:
    """``dataset_flickr30k.json`` and ``flickr30k-images/`` as Karpathy's split distributes them;
    returns the expected image ids per split."""
    (root / "flickr30k-images").mkdir(parents=True)
    images, expected = [], {"train": [], "val": [], "test": []}
    for k, ((photo, raws), split) in enumerate(zip(_photos(10), FLICKR30K_SPLITS, strict=True)):
        filename = f"{1000092795 + k}.jpg"  # Flickr30k names its photos by Flickr id
        shutil.copyfile(photo, root / "flickr30k-images" / filename)
        images.append(
            {
                "sentids": list(range(5 * k, 5 * k + 5)),
                "imgid": k,
                "sentences": _sentences(raws, k, 5 * k),
                "split": split,
                "filename": filename,
            }
        )
        expected[split].append(filename.removesuffix(".jpg"))
    (root / "dataset_flickr30k.json").write_text(
        json.dumps({"images": images, "dataset": "flickr30k"})
    )
    return expected


# (folder, split in Karpathy's file) of each photo: train2014 trains; val2014 holds val, test
# and restval, which the profile trains on
COCO_PHOTOS = [("train2014", "train")] * 5 + [("val2014", "restval")] * 2
COCO_PHOTOS += [("val2014", "val")] * 2 + [("val2014", "test")] * 2
COCO_IDS = [391895 + 1000 * k for k in range(len(COCO_PHOTOS))]


def coco_slice(root: Path) -> None:
    """``train2014/``, ``val2014/``, COCO's two caption files and Karpathy's ``dataset_coco.json``
    over the same photos. The last photo has a sixth caption, as some COCO photos do."""
    karpathy, files = [], {}
    for name in ("train2014", "val2014"):
        (root / name).mkdir(parents=True)
        files[name] = {
            "info": {"description": "COCO 2014 Dataset", "version": "1.0", "year": 2014},
            "licenses": [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1}],
            "images": [],
            "annotations": [],
        }
    ann_id = 48
    for k, ((photo, raws), (folder, split), cocoid) in enumerate(
        zip(_photos(len(COCO_PHOTOS)), COCO_PHOTOS, COCO_IDS, strict=True)
    ):
        filename = f"COCO_{folder}_{cocoid:012d}.jpg"
        shutil.copyfile(photo, root / folder / filename)
        raws = raws + ["A sixth caption of the last photo."] * (k == len(COCO_PHOTOS) - 1)
        files[folder]["images"].append(
            {
                "license": 1,
                "file_name": filename,
                "coco_url": f"http://images.cocodataset.org/{folder}/{filename}",
                "height": 375,
                "width": 500,
                "date_captured": "2013-11-14 11:18:45",
                "flickr_url": "http://farm4.staticflickr.com/x.jpg",
                "id": cocoid,
            }
        )
        for raw in raws:
            files[folder]["annotations"].append({"image_id": cocoid, "id": ann_id, "caption": raw})
            ann_id += 1
        karpathy.append(
            {
                "filepath": folder,
                "sentids": list(range(5 * k, 5 * k + 5)),
                "filename": filename,
                "imgid": k,
                "split": split,
                "sentences": _sentences(raws[:5], k, 5 * k),
                "cocoid": cocoid,
            }
        )
    (root / "annotations").mkdir()
    for name, data in files.items():
        (root / "annotations" / f"captions_{name}.json").write_text(json.dumps(data))
    (root / "dataset_coco.json").write_text(json.dumps({"images": karpathy, "dataset": "coco"}))


def _prepare_and_extract(profile: str, data_root: Path, out: Path, *more: str) -> dict:
    """The profile's own params with only the data root and the outputs moved; returns the
    prepare report after both stages ran."""
    ctx = load_context(
        ROOT / "profiles" / profile / "params.yaml",
        [
            f"data.root={data_root}",
            f"data.prepared_dir={out / 'prepared'}",
            f"encoder.features_dir={out / 'features'}",
            f"eval.reports_dir={out / 'reports'}",
            "encoder.num_workers=0",
            *more,
        ],
    )
    assert prepare(ctx) == 0
    assert extract(ctx) == 0
    return json.loads((out / "prepared" / "prepare_report.json").read_text())


def _store_ids(out: Path, split: str) -> list[str]:
    store = FeatureStore(out / "features" / f"{split}.arrow")
    try:
        # the profile's encoder, Lite2 at 330 px: 11x11 cells of 1280 channels
        assert (store.spec.name, store.spec.L, store.spec.D) == ("efficientnet_lite2", 121, 1280)
        return sorted(store.ids)
    finally:
        store.close()


def test_the_flickr30k_profile_prepares_and_extracts_karpathys_split(tmp_path: Path) -> None:
    expected = flickr30k_slice(tmp_path / "flickr30k")
    report = _prepare_and_extract("flickr30k", tmp_path / "flickr30k", tmp_path / "out")
    assert (report["images_train"], report["images_val"], report["images_test"]) == (6, 2, 2)
    assert report["captions_kept"] + report["captions_skipped"] == 50
    for split, ids in expected.items():
        assert _store_ids(tmp_path / "out", split) == sorted(ids)


def test_the_coco_profile_prepares_and_extracts_cocos_caption_files(tmp_path: Path) -> None:
    coco_slice(tmp_path / "coco")
    # the paper's 5,000 / 5,000 held-out photos, scaled to the slice's six val2014 photos
    sizes = ["data.coco.val_images=2", "data.coco.test_images=2"]
    report = _prepare_and_extract("coco", tmp_path / "coco", tmp_path / "out", *sizes)
    # train2014's 5 and the 2 val2014 photos beyond val and test (restval) train
    assert (report["images_train"], report["images_val"], report["images_test"]) == (7, 2, 2)
    assert report["captions_total"] == 56  # the sixth caption is read, then left out
    excluded = [s for s in report["skipped"] if s["reason"].startswith("excluded")]
    assert len(excluded) == 1 and "max_captions_per_image=5" in excluded[0]["reason"]
    ids = {split: _store_ids(tmp_path / "out", split) for split in ("train", "val", "test")}
    assert sorted(i for split_ids in ids.values() for i in split_ids) == sorted(map(str, COCO_IDS))
    assert set(ids["train"]) >= {str(i) for i in COCO_IDS[:5]}  # train2014 trains


def test_the_coco_profile_reads_karpathys_dataset_coco_json(tmp_path: Path) -> None:
    coco_slice(tmp_path / "coco")
    karpathy = ["data.source=karpathy"]  # the switch the profile's header names
    report = _prepare_and_extract("coco", tmp_path / "coco", tmp_path / "out", *karpathy)
    # restval trains (karpathy.restval_to_train), as in the papers that use this split
    assert (report["images_train"], report["images_val"], report["images_test"]) == (7, 2, 2)
    split_of = dict(zip(COCO_IDS, (s for _, s in COCO_PHOTOS), strict=True))
    for split in ("val", "test"):
        want = sorted(str(i) for i, s in split_of.items() if s == split)
        assert _store_ids(tmp_path / "out", split) == want
