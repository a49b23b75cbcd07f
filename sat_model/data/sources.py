"""Readers for the five caption sources, all returning one :class:`SourceData`.

A reader parses its source's metadata only: which images exist, their split and file, and
their raw captions. It never opens an image (``sat_model.data.prepare`` checks files for every
source alike). Problems found while parsing are kept, not raised: an image gets a ``status``
other than ``"ok"`` (a duplicate id, no split, ...) and a caption that cannot be attached to
an image becomes a :class:`Skip`. Items left out on purpose by a params setting (Karpathy's
``restval``, COCO captions beyond the first five) carry reasons starting with
``EXCLUDED`` and do not count as bad input.

``file`` is the name as written in the source, relative to ``image_root``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np

from sat_model.config import DataConfig
from sat_model.data.datasets import missing_dataset
from sat_model.data.scenes import generate_scenes
from sat_model.data.tables import Box
from sat_model.registry import Registry

__all__ = [
    "EXCLUDED",
    "LEAVES_FOLDER",
    "OK",
    "Skip",
    "SourceCaption",
    "SourceData",
    "SourceError",
    "SourceImage",
    "dataset_missing",
    "image_root",
    "list_sources",
    "read_coco",
    "read_flickr8k",
    "read_folder",
    "read_karpathy",
    "read_source",
    "read_synthetic",
    "register_source",
    "source_needs_root",
]

EXCLUDED = "excluded"
OK = "ok"
LEAVES_FOLDER = "file name leaves the dataset folder"


class SourceError(ValueError):
    """Raised when a source cannot be read at all (a missing or unparseable index file)."""


@dataclass(frozen=True)
class SourceImage:
    image_id: str
    split: str | None
    file: str
    status: str = OK
    boxes: tuple[Box, ...] = ()


@dataclass(frozen=True)
class SourceCaption:
    image_id: str
    raw: str
    item: str  # where it came from, for skip messages ("Flickr8k.token.txt line 12")


@dataclass(frozen=True)
class Skip:
    item: str
    reason: str
    kind: Literal["image", "caption"]

    @property
    def excluded(self) -> bool:
        return self.reason.startswith(EXCLUDED)


@dataclass(frozen=True)
class SourceData:
    source: str
    image_root: Path  # absolute
    images: tuple[SourceImage, ...]
    # captions attached to an image row (usable or not: prepare counts those of skipped images)
    captions: tuple[SourceCaption, ...]
    skipped: tuple[Skip, ...] = field(default=())  # captions dropped while parsing


class _Images:
    """Collects image rows in source order; the first row of an id wins, later ones are marked."""

    def __init__(self) -> None:
        self.rows: list[SourceImage] = []
        self.first: dict[str, SourceImage] = {}  # id -> its usable row
        self.best: dict[str, SourceImage] = {}  # id -> its usable row, else its first row

    def add(self, image: SourceImage) -> SourceImage:
        if _leaves_folder(image.file):
            image = SourceImage(image.image_id, image.split, image.file, LEAVES_FOLDER)
        self.best.setdefault(image.image_id, image)
        if image.status != OK:  # an unusable row never blocks a later valid one with its id
            self.rows.append(image)
            return image
        if image.image_id in self.first:
            prior = self.first[image.image_id]
            image = SourceImage(
                image.image_id,
                image.split,
                image.file,
                f"duplicate image id {image.image_id!r} (first listed as {prior.file!r}"
                f" in split {prior.split})",
            )
        else:
            self.first[image.image_id] = self.best[image.image_id] = image
        self.rows.append(image)
        return image


def _leaves_folder(file: str) -> bool:
    """True for a name that points outside the dataset folder (absolute, ``..``, a drive)."""
    # string tests, not PurePosixPath/PureWindowsPath objects: called for every caption row
    return (
        not file.strip()
        or file.startswith("/")
        or ".." in file.split("/")
        or "\\" in file
        or (file[1:2] == ":" and file[:1].isascii() and file[:1].isalpha())  # a drive, C:
    )


def _attach(
    row: SourceImage, raw: str, item: str, captions: list[SourceCaption], skipped: list[Skip]
) -> None:
    """Add a caption of ``row``; one of an unusable row is skipped, never given to another row
    that shares its id (``../a.jpg`` and ``a.jpg`` both have the id ``a``)."""
    if row.status == OK:
        captions.append(SourceCaption(row.image_id, raw, item))
    elif row.status.startswith(EXCLUDED):
        skipped.append(Skip(item, row.status, "caption"))
    else:
        skipped.append(Skip(item, f"image skipped: {row.status}", "caption"))


def _stem(name: str) -> str:
    return PurePosixPath(name).stem if name.strip() else name


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise SourceError(f"cannot read {what} {path}: {e.strerror or e}") from e


def _lines(path: Path, what: str) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text or None when not UTF-8) for each non-blank line."""
    for n, raw in enumerate(_read(path, what).split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            yield n, None
            continue
        if line.strip():
            yield n, line


# ----------------------------------------------------------------------------- flickr8k
def read_flickr8k(
    root: Path, images_dir: str, token_file: str, split_lists: dict[str, str]
) -> SourceData:
    """Flickr8k as distributed: a ``name#n<TAB>caption`` token file and one list per split."""
    images, skipped = _Images(), []
    row_of: dict[str, SourceImage] = {}  # file name -> its first usable row (else first row)
    for split, rel in split_lists.items():
        for n, line in _lines(root / rel, f"{split} split list"):
            if line is None:
                skipped.append(Skip(f"{rel} line {n}", "line is not UTF-8", "image"))
                continue
            name = line.strip()
            row = images.add(SourceImage(_stem(name), split, name))
            if name not in row_of or (row.status == OK and row_of[name].status != OK):
                row_of[name] = row
    captions: list[SourceCaption] = []
    for n, line in _lines(root / token_file, "token file"):
        item = f"{PurePosixPath(token_file).name} line {n}"
        if line is None:
            skipped.append(Skip(item, "line is not UTF-8", "caption"))
            continue
        name, tab, raw = line.partition("\t")
        name = name.rpartition("#")[0] if "#" in name else ""
        if not tab or not name:
            skipped.append(
                Skip(item, "malformed line: expected '<image>#<n><TAB><caption>'", "caption")
            )
            continue
        if name not in row_of:
            row_of[name] = images.add(SourceImage(_stem(name), None, name, "image is in no split"))
        _attach(row_of[name], raw, item, captions, skipped)
    return SourceData(
        "flickr8k",
        (root / images_dir).resolve(),
        tuple(images.rows),
        tuple(captions),
        tuple(skipped),
    )


# ----------------------------------------------------------------------------- karpathy
def _load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(_read(path, what))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise SourceError(f"{what} {path} must hold a JSON object")
    return data


def read_karpathy(
    root: Path, json_file: str, images_dir: str, restval_to_train: bool
) -> SourceData:
    """Karpathy's split file (``dataset_{flickr8k,flickr30k,coco}.json``)."""
    data = _load_json(root / json_file, "Karpathy split file")
    images = _Images()
    captions: list[SourceCaption] = []
    skipped: list[Skip] = []
    for k, entry in enumerate(data.get("images", [])):
        name = str(entry.get("filename", ""))
        file = f"{entry['filepath']}/{name}" if entry.get("filepath") else name
        # COCO entries carry the COCO id, so Karpathy-COCO and raw COCO agree on ids
        image_id = str(entry["cocoid"]) if "cocoid" in entry else _stem(name)
        split, status = entry.get("split"), OK
        if split == "restval":
            split = "train" if restval_to_train else None
            status = OK if restval_to_train else f"{EXCLUDED}: restval (karpathy.restval_to_train)"
        elif split not in ("train", "val", "test"):
            split, status = None, f"image is in no split (split {entry.get('split')!r})"
        row = images.add(SourceImage(image_id, split, file, status))
        for j, sentence in enumerate(entry.get("sentences", [])):
            item = f"{json_file} image {k} sentence {j}"
            raw = sentence.get("raw") if isinstance(sentence, dict) else None
            if not isinstance(raw, str):
                skipped.append(Skip(item, "sentence has no raw text", "caption"))
                continue
            _attach(row, raw, item, captions, skipped)
    return SourceData(
        "karpathy",
        (root / images_dir).resolve(),
        tuple(images.rows),
        tuple(captions),
        tuple(skipped),
    )


# --------------------------------------------------------------------------------- coco
def _coco_splits(
    ids: list[int], val_images: int, test_images: int, seed: int, rest_to_train: bool
) -> dict[int, str | None]:
    """Split the held-out pool: ``val_images`` val, ``test_images`` test, the rest train or none."""
    ordered = sorted(ids)
    pool = [ordered[i] for i in np.random.default_rng(seed).permutation(len(ids))]
    rest = "train" if rest_to_train else None
    return {
        image_id: "val" if i < val_images else "test" if i < val_images + test_images else rest
        for i, image_id in enumerate(pool)
    }


def read_coco(
    root: Path,
    annotation_files: tuple[str, ...],
    images_dirs: tuple[str, ...],
    val_images: int,
    test_images: int,
    seed: int,
    max_captions_per_image: int,
    rest_to_train: bool,
) -> SourceData:
    """MS COCO captions JSON: the first file trains; val/test are drawn from the others."""
    if len(annotation_files) != len(images_dirs):
        raise SourceError(
            f"{len(annotation_files)} annotation files but {len(images_dirs)} image folders"
        )
    files = [_load_json(root / a, "COCO captions file") for a in annotation_files]
    held_out = sorted({int(im["id"]) for d in files[1:] for im in d.get("images", [])})
    split_of = _coco_splits(held_out, val_images, test_images, seed, rest_to_train)
    images = _Images()
    captions: list[SourceCaption] = []
    skipped: list[Skip] = []
    for k, (data, folder, ann_file) in enumerate(
        zip(files, images_dirs, annotation_files, strict=True)
    ):
        for im in data.get("images", []):
            split = "train" if k == 0 else split_of[int(im["id"])]
            status = OK if split else f"{EXCLUDED}: held-out image beyond val/test (coco)"
            images.add(
                SourceImage(str(im["id"]), split, f"{folder}/{im.get('file_name', '')}", status)
            )
        per_image: dict[str, int] = {}
        for ann in sorted(
            data.get("annotations", []), key=lambda a: (a.get("image_id", -1), a.get("id", 0))
        ):
            image_id, item = str(ann.get("image_id")), f"{ann_file} annotation {ann.get('id')}"
            row = images.best.get(image_id)
            if row is None:
                reason = f"image id {image_id} is not in the images list"
                skipped.append(Skip(item, reason, "caption"))
            elif row.status == OK and per_image.get(image_id, 0) >= max_captions_per_image:
                reason = f"{EXCLUDED}: beyond coco.max_captions_per_image={max_captions_per_image}"
                skipped.append(Skip(item, reason, "caption"))
            else:
                per_image[image_id] = per_image.get(image_id, 0) + 1
                _attach(row, str(ann.get("caption", "")), item, captions, skipped)
    return SourceData("coco", root.resolve(), tuple(images.rows), tuple(captions), tuple(skipped))


# ------------------------------------------------------------------------------- folder
@dataclass(frozen=True)
class _Row:
    item: str  # "captions.csv line 12"
    file: str
    caption: str
    split: str | None


def _csv_rows(path: Path, name: str) -> tuple[list[_Row | Skip], bool]:
    """The rows of a CSV captions file and whether it has a split column."""
    try:
        text = _read(path, "captions file").decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SourceError(f"captions file {path} is not UTF-8: {e}") from e
    reader = csv.DictReader(io.StringIO(text, newline=""))
    # a spreadsheet's "File" or " caption" header names the same column
    columns = [c.strip().lower() for c in reader.fieldnames or []]
    reader.fieldnames = columns
    missing = [c for c in ("file", "caption") if c not in columns]
    if missing:
        raise SourceError(
            f"captions file {path} has no column {' or '.join(missing)} (its header: {columns}; "
            "expected file, caption and optionally split)"
        )
    rows: list[_Row | Skip] = []
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # a field over csv's size limit, say: that line, not the file
            rows.append(Skip(f"{name} after line {reader.line_num}", f"malformed line: {e}", "caption"))
            continue
        item = f"{name} line {reader.line_num}"
        if record.get(None):  # DictReader: the fields beyond the header
            reason = f"malformed line: more fields than the header's {len(columns)} (a comma in "
            rows.append(Skip(item, reason + "a caption needs quotes)", "caption"))
            continue
        split = record.get("split") if "split" in columns else None
        rows.append(_Row(item, record["file"] or "", record["caption"] or "", split))
    return rows, "split" in columns


def _jsonl_rows(path: Path, name: str) -> tuple[list[_Row | Skip], bool]:
    """The rows of a JSON-lines captions file (one object a line) and whether one has a split."""
    rows: list[_Row | Skip] = []
    has_split = False
    for n, line in _lines(path, "captions file"):
        item = f"{name} line {n}"
        try:
            record = json.loads(line) if line is not None else None
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            rows.append(Skip(item, "malformed line: expected a JSON object", "caption"))
            continue
        file, caption, split = record.get("file"), record.get("caption"), record.get("split")
        if not isinstance(file, str) or not isinstance(caption, str):
            rows.append(Skip(item, "malformed line: file and caption must be text", "caption"))
            continue
        has_split = has_split or "split" in record
        rows.append(_Row(item, file, caption, split if isinstance(split, str) else None))
    return rows, has_split


def _screen_rows(rows: list[_Row | Skip], has_split: bool) -> tuple[list[_Row], list[Skip]]:
    """Drop malformed and duplicate rows and rows whose split is missing or contradicts the
    file's first row; keep the others with their file name normalised (``./a.jpg`` is
    ``a.jpg``)."""
    kept: list[_Row] = []
    skipped: list[Skip] = []
    first_of: dict[tuple[str, str], str] = {}  # (file, caption) -> the row that gave it first
    split_of: dict[str, tuple[str | None, str]] = {}  # file -> (its split, the row that set it)
    for row in rows:
        if isinstance(row, Skip):
            skipped.append(row)
            continue
        file = row.file.strip()
        file = PurePosixPath(file).as_posix() if file and not _leaves_folder(file) else file
        split = (row.split or "").strip().lower() or None
        key = (file, " ".join(row.caption.split()))
        reason = ""
        if not file:
            reason = "no file name"
        elif "\0" in file:
            reason = "the file name holds a NUL byte"
        elif key in first_of:
            reason = f"duplicate row (the same file and caption as {first_of[key]})"
        elif has_split and split not in ("train", "val", "test"):
            reason = f"split {row.split!r} is not train, val or test"
        elif file in split_of and split_of[file][0] != split:
            prior, where = split_of[file]
            reason = f"split {split!r} contradicts {prior!r} given to {file!r} by {where}"
        if reason:
            skipped.append(Skip(row.item, reason, "caption"))
            continue
        first_of[key] = row.item
        split_of.setdefault(file, (split, row.item))
        kept.append(_Row(row.item, file, row.caption, split))
    return kept, skipped


def _draw_splits(files: list[str], val_images: int, test_images: int, seed: int) -> dict[str, str]:
    """A seeded draw: ``val_images`` files val, ``test_images`` test, the rest train."""
    ordered = sorted(files)
    pool = [ordered[i] for i in np.random.default_rng(seed).permutation(len(files))]
    return {
        file: "val" if i < val_images else "test" if i < val_images + test_images else "train"
        for i, file in enumerate(pool)
    }


def read_folder(
    root: Path,
    images_dir: str,
    captions_file: str,
    fmt: Literal["auto", "csv", "jsonl"],
    val_images: int,
    test_images: int,
    seed: int,
) -> SourceData:
    """A folder of photos and a captions file (CSV or JSON lines: ``file``, ``caption`` and an
    optional ``split``; one row per caption). ``file`` is relative to ``images_dir`` and is the
    image's id. Without a split column the images are split by :func:`_draw_splits`."""
    path = root / captions_file
    if fmt == "auto":
        fmt = "jsonl" if path.suffix.lower() in (".jsonl", ".json") else "csv"
    read = _jsonl_rows if fmt == "jsonl" else _csv_rows
    rows, has_split = read(path, PurePosixPath(captions_file).name)
    kept, skipped = _screen_rows(rows, has_split)
    files = list(dict.fromkeys(r.file for r in kept))  # first-row order
    drawn = (
        {}
        if has_split
        else _draw_splits(
            [f for f in files if not _leaves_folder(f)], val_images, test_images, seed
        )
    )
    images = _Images()
    row_of: dict[str, SourceImage] = {}
    for row in kept:
        if row.file not in row_of:
            split = row.split if has_split else drawn.get(row.file)
            row_of[row.file] = images.add(SourceImage(row.file, split, row.file))
    captions: list[SourceCaption] = []
    for row in kept:
        _attach(row_of[row.file], row.caption, row.item, captions, skipped)
    return SourceData(
        "folder", (root / images_dir).resolve(), tuple(images.rows), tuple(captions), tuple(skipped)
    )


# ---------------------------------------------------------------------------- synthetic
def read_synthetic(
    images_dir: Path,
    split_sizes: dict[str, int],
    seed: int,
    image_size: int,
    min_objects: int,
    max_objects: int,
    captions_per_image: int,
    workers: int | None = None,
) -> SourceData:
    """Generate the scenes (PNGs into ``images_dir``) and describe them like any source."""
    scenes = generate_scenes(
        images_dir,
        split_sizes,
        seed,
        image_size,
        min_objects,
        max_objects,
        captions_per_image,
        workers,
    )
    images, captions = [], []
    for s in scenes:
        boxes = tuple(
            Box(*o.box, label=o.label, shape=o.shape, colour=o.colour, size=o.size)
            for o in s.objects
        )
        images.append(SourceImage(s.image_id, s.split, f"{s.image_id}.png", OK, boxes))
        captions += [
            SourceCaption(s.image_id, c, f"{s.image_id}#{i}") for i, c in enumerate(s.captions)
        ]
    return SourceData("synthetic", Path(images_dir).resolve(), tuple(images), tuple(captions))


# (data params, data.root, the prepared folder, decode workers) -> what the source holds
SourceReader = Callable[[DataConfig, Path, Path, "int | None"], SourceData]
# (data params, data.root, the prepared folder) -> the folder its images are read from
ImageRoot = Callable[[DataConfig, Path, Path], Path]


@dataclass(frozen=True)
class _Source:
    read: SourceReader
    images: ImageRoot
    needs_root: bool  # reads files under data.root (every source but the generated scenes)


_SOURCES: Registry[_Source] = Registry("data source", SourceError)


def register_source(
    name: str, *, images: ImageRoot | None = None, needs_root: bool = True
) -> Callable[[SourceReader], SourceReader]:
    """Decorator: add the data source ``name`` (``data.source`` in params). ``images`` says
    where its images are (default: ``data.root``); a source with settings of its own reads them
    from its section of :class:`DataConfig`."""

    def add(read: SourceReader) -> SourceReader:
        _SOURCES.add(name, _Source(read, images or (lambda data, root, prepared: root), needs_root))
        return read

    return add


def list_sources() -> list[str]:
    """The registered data sources, sorted."""
    return sorted(_SOURCES)


def source_needs_root(name: str) -> bool:
    """Whether source ``name`` reads files under ``data.root``."""
    return _SOURCES[name].needs_root


def image_root(data: DataConfig, base_dir: Path) -> Path:
    """The folder images are read from, from params alone (the one ``read_source`` reads).

    Relative ``data.root`` and ``data.prepared_dir`` resolve against ``base_dir``.
    """
    base = Path(base_dir)
    root = base / data.root if data.root else base
    return _SOURCES[data.source].images(data, root, base / data.prepared_dir).resolve()


@register_source(
    "synthetic", needs_root=False, images=lambda data, root, prepared: prepared / "images"
)
def _synthetic(data: DataConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    s = data.synthetic
    return read_synthetic(
        prepared_dir / "images",
        {"train": s.train_images, "val": s.val_images, "test": s.test_images},
        seed=s.seed,
        image_size=s.image_size,
        min_objects=s.min_objects,
        max_objects=s.max_objects,
        captions_per_image=s.captions_per_image,
        workers=workers,
    )


@register_source("flickr8k", images=lambda data, root, prepared: root / data.flickr8k.images_dir)
def _flickr8k(data: DataConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    f = data.flickr8k
    lists = {"train": f.train_list, "val": f.val_list, "test": f.test_list}
    present = {k: v for k, v in lists.items() if (root / v).is_file()}  # the sample: no test list
    return read_flickr8k(root, f.images_dir, f.token_file, present)


@register_source("karpathy", images=lambda data, root, prepared: root / data.karpathy.images_dir)
def _karpathy(data: DataConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    k = data.karpathy
    return read_karpathy(root, k.json_file, k.images_dir, k.restval_to_train)


@register_source("coco")  # file names carry their images_dirs folder
def _coco(data: DataConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    c = data.coco
    return read_coco(
        root,
        annotation_files=c.annotation_files,
        images_dirs=c.images_dirs,
        val_images=c.val_images,
        test_images=c.test_images,
        seed=c.seed,
        max_captions_per_image=c.max_captions_per_image,
        rest_to_train=c.restval_to_train,
    )


@register_source("folder", images=lambda data, root, prepared: root / data.folder.images_dir)
def _folder(data: DataConfig, root: Path, prepared_dir: Path, workers: int | None) -> SourceData:
    f = data.folder
    return read_folder(
        root, f.images_dir, f.captions_file, f.format, f.val_images, f.test_images, f.seed
    )


def read_source(
    data: DataConfig, prepared_dir: Path, base_dir: Path, workers: int | None = None
) -> SourceData:
    """Read the source that ``data.source`` names."""
    root = base_dir / data.root if data.root else base_dir
    if missing := dataset_missing(data, base_dir):
        raise SourceError(missing)
    return _SOURCES[data.source].read(data, root, prepared_dir, workers)


def dataset_missing(data: DataConfig, base_dir: Path) -> str:
    """``""`` when what ``data.source`` reads is under ``data.root``, else the one line saying
    where to get it and where to put it (:mod:`sat_model.data.datasets`)."""
    if not _SOURCES[data.source].needs_root:
        return ""
    return missing_dataset(data, (base_dir / data.root if data.root else base_dir).resolve())
