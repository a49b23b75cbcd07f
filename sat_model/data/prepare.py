"""The ``prepare`` stage: a caption source -> ``captions.parquet``, ``images.parquet``,
``vocab.json`` and ``prepare_report.json`` (names and schemas owned by
:mod:`sat_model.data.tables`).

Bad input never stops the stage by itself: each bad image or caption is skipped with its
reason (in ``images.parquet`` and the report) and every valid item is kept. The stage fails
with :class:`PrepareError` only when a required split ends up empty or the share of bad items
passes ``max_bad_fraction``. Items left out on purpose by params (reasons starting with
``excluded``) are reported but are not bad. Outputs are written atomically and are
byte-identical for the same input (rows sorted by id).
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from sat_model.atomic import write_bytes_atomic, write_text_atomic
from sat_model.config import DataConfig
from sat_model.data.sources import (
    EXCLUDED,
    LEAVES_FOLDER,
    OK,
    Skip,
    SourceCaption,
    SourceData,
    SourceImage,
    read_source,
)
from sat_model.data.tables import (
    CAPTIONS_FILE,
    CAPTIONS_SCHEMA,
    IMAGES_FILE,
    IMAGES_SCHEMA,
    REPORT_FILE,
    SPLITS,
    VOCAB_FILE,
)
from sat_model.data.text import tokenize
from sat_model.features.formats import FILE_FORMATS
from sat_model.data.vocab import Vocab, build_vocab, save_vocab
from sat_model.paths import resolve_inside

__all__ = [
    "REPORT_KEYS",
    "ImageCheck",
    "PrepareError",
    "PrepareResult",
    "check_image",
    "prepare_dataset",
    "prepare_source",
]

REPORT_KEYS = (
    "images_total",
    "images_ok",
    "images_skipped",
    "captions_total",
    "captions_kept",
    "captions_skipped",
    "vocab_size",
    *(f"images_{s}" for s in SPLITS),
)


class PrepareError(RuntimeError):
    """The prepared data would be unusable: a required split is empty or too much was bad."""


@dataclass(frozen=True)
class ImageCheck:
    status: str  # "ok" or why the image is unusable
    width: int | None
    height: int | None


@dataclass(frozen=True)
class PrepareResult:
    prepared_dir: Path
    report: dict[str, object]
    vocab: Vocab


# -------------------------------------------------------------------------------- images
def check_image(path: Path, verify: bool, max_pixels: int) -> ImageCheck:
    """Open ``path`` (and with ``verify`` decode it fully); say why it is unusable, if it is."""
    try:
        if path.stat().st_size == 0:
            return ImageCheck("empty file (0 bytes)", None, None)
    except OSError:
        return ImageCheck("missing image file", None, None)
    width = height = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # the photo formats every later stage opens, so no other Pillow plugin (EPS and its
            # Ghostscript, say) ever reads a user's file
            with Image.open(path, formats=list(FILE_FORMATS)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    reason = f"too many pixels ({width}x{height} > max_image_pixels {max_pixels})"
                    return ImageCheck(reason, width, height)
                if verify:
                    image.load()  # decodes every byte: a truncated file raises here
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return ImageCheck(f"too many pixels (decompression bomb guard): {e}", width, height)
    except UnidentifiedImageError:
        return ImageCheck("not a readable image", None, None)
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's errors for corrupt/truncated data
        return ImageCheck(f"corrupt or truncated image: {e}", width, height)
    return ImageCheck(OK, width, height)


def _check_images(
    src: SourceData, verify: bool, max_pixels: int, workers: int | None
) -> list[ImageCheck]:
    def check(image: SourceImage) -> ImageCheck:
        if image.status != OK:
            return ImageCheck(image.status, None, None)
        if resolve_inside(src.image_root, image.file)[1]:  # symbolic links out of the dataset
            return ImageCheck(LEAVES_FOLDER, None, None)
        return check_image(src.image_root / image.file, verify, max_pixels)

    # Pillow decodes without the GIL, so threads use every core for the JPEG work
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(check, src.images))


# ------------------------------------------------------------------------------ captions
@dataclass(frozen=True)
class _Kept:
    image_id: str
    caption_index: int
    raw: str
    tokens: list[str]


def _filter_captions(
    captions: Sequence[SourceCaption], ok_ids: set[str], max_length: int
) -> tuple[list[_Kept], list[Skip]]:
    """Tokenise the captions of usable images; return the kept and the skipped ones."""
    kept, skipped = [], []
    index: Counter[str] = Counter()
    for c in captions:
        i = index[c.image_id]
        index[c.image_id] += 1  # position among the image's source captions: a stable identity
        if c.image_id not in ok_ids:
            continue  # its image's own skip entry gives the reason
        tokens = tokenize(c.raw)
        if not tokens:
            skipped.append(Skip(c.item, "empty caption", "caption"))
        elif len(tokens) > max_length:
            reason = f"caption longer than max_caption_length {max_length} ({len(tokens)} tokens)"
            skipped.append(Skip(c.item, reason, "caption"))
        else:
            kept.append(_Kept(c.image_id, i, c.raw, tokens))
    return kept, skipped


# -------------------------------------------------------------------------------- tables
def _to_parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _images_table(
    src: SourceData, checks: list[ImageCheck], statuses: list[str], out_dir: Path
) -> pa.Table:
    order = sorted(range(len(src.images)), key=lambda i: (src.images[i].image_id, i))
    rows = [src.images[i] for i in order]
    columns = {
        "image_id": [r.image_id for r in rows],
        "split": [r.split for r in rows],
        "file": [r.file for r in rows],
        "width": [checks[i].width for i in order],
        "height": [checks[i].height for i in order],
        "status": [statuses[i] for i in order],
        "boxes": [[asdict(b) for b in r.boxes] for r in rows],
    }
    # a record only (readers take the root from params), relative to the table's folder: an
    # absolute path would differ between two checkouts of the same project, and with it the
    # table's hash, so a dvc.lock made in one would re-run everything in the other
    meta = {"image_root": _relative_to(src.image_root, out_dir), "source": src.source}
    return pa.table(columns, schema=IMAGES_SCHEMA.with_metadata(meta))


def _relative_to(path: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(path, start)).as_posix()
    except ValueError:  # another drive (Windows): no relative path exists
        return str(path)


def _captions_table(kept: list[_Kept], ok_rows: dict[str, SourceImage]) -> pa.Table:
    rows = sorted(kept, key=lambda k: (k.image_id, k.caption_index))
    columns = {
        "image_id": [k.image_id for k in rows],
        "split": [ok_rows[k.image_id].split for k in rows],
        "file": [ok_rows[k.image_id].file for k in rows],
        "caption_index": [k.caption_index for k in rows],
        "raw": [k.raw for k in rows],
        "tokens": [k.tokens for k in rows],
    }
    return pa.table(columns, schema=CAPTIONS_SCHEMA)


# --------------------------------------------------------------------------------- stage
def _skips_of_images(src: SourceData, statuses: list[str]) -> list[Skip]:
    return [
        Skip(image.file or image.image_id, status, "image")
        for image, status in sorted(
            zip(src.images, statuses, strict=True), key=lambda p: p[0].image_id
        )
        if status != OK
    ]


def _check_usable(
    report: dict[str, object],
    required_splits: Sequence[str],
    bad: dict[str, tuple[int, int, list[Skip]]],
    max_bad_fraction: float,
) -> None:
    """Raise :class:`PrepareError` naming the cause when the prepared data would be unusable."""
    empty = [s for s in required_splits if report[f"images_{s}"] == 0]
    if empty:
        usable = {s: report[f"images_{s}"] for s in SPLITS}
        raise PrepareError(
            f"required split(s) {empty} have no usable image (usable per split: {usable}; "
            f"data.required_splits={list(required_splits)})"
        )
    for what, (n_bad, n_all, skips) in bad.items():
        if n_all and n_bad / n_all > max_bad_fraction:
            reasons = Counter(s.reason for s in skips if not s.excluded).most_common(3)
            raise PrepareError(
                f"{n_bad} of {n_all} {what} are bad ({n_bad / n_all:.1%} > data.max_bad_fraction "
                f"{max_bad_fraction:.1%}); most common reasons: {reasons}"
            )


def prepare_source(
    src: SourceData, data: DataConfig, out_dir: Path, workers: int | None = None
) -> PrepareResult:
    """Check ``src`` as ``data`` (the ``data`` params section) asks, build the vocabulary from
    train captions, and write the four outputs."""
    v = data.vocab
    screen = _screen(src, data.verify_images, data.max_image_pixels, workers, v.max_caption_length)
    vocab = build_vocab(
        (k.tokens for k in screen.kept if screen.ok_rows[k.image_id].split == "train"),
        min_count=v.min_count,
        max_size=v.max_size,
        max_caption_length=v.max_caption_length,
    )
    report = _report(src, screen, vocab)
    _check_usable(report, data.required_splits, _bad_counts(src, screen), data.max_bad_fraction)
    images = _images_table(src, screen.checks, screen.statuses, out_dir)
    captions = _captions_table(screen.kept, screen.ok_rows)
    _write_outputs(out_dir, images, captions, vocab, report)
    return PrepareResult(out_dir, report, vocab)


@dataclass(frozen=True)
class _Screen:
    """What the image and caption checks kept and left out (internal)."""

    checks: list[ImageCheck]
    statuses: list[str]  # per source image: OK or why it is left out
    ok_rows: dict[str, SourceImage]  # usable images (with a usable caption) by id
    kept: list[_Kept]
    image_skips: list[Skip]
    caption_skips: list[Skip]  # the source's own and the caption filter's
    orphans: list[SourceCaption]  # captions of images left out
    status_of: dict[str, str]  # image id -> status, for the source's usable rows
    captions_total: int


def _screen(
    src: SourceData,
    verify_images: bool,
    max_image_pixels: int,
    workers: int | None,
    max_caption_length: int,
) -> _Screen:
    """Check every image, filter the captions, and leave out images with no usable caption."""
    checks = _check_images(src, verify_images, max_image_pixels, workers)
    statuses = [c.status for c in checks]
    ok_rows = {im.image_id: im for im, st in zip(src.images, statuses, strict=True) if st == OK}
    kept, caption_skips = _filter_captions(src.captions, set(ok_rows), max_caption_length)
    with_captions = {k.image_id for k in kept}
    for i, image in enumerate(src.images):
        if statuses[i] == OK and image.image_id not in with_captions:
            statuses[i] = "no usable caption"
            del ok_rows[image.image_id]
    # ids of usable source rows are unique, so a caption's image is its id's usable row
    status_of = {
        im.image_id: st for im, st in zip(src.images, statuses, strict=True) if im.status == OK
    }
    return _Screen(
        checks=checks,
        statuses=statuses,
        ok_rows=ok_rows,
        kept=kept,
        image_skips=_skips_of_images(src, statuses),
        caption_skips=[*src.skipped, *caption_skips],
        orphans=[c for c in src.captions if status_of[c.image_id] != OK],
        status_of=status_of,
        captions_total=len(src.captions) + len(src.skipped),
    )


def _report(src: SourceData, screen: _Screen, vocab: Vocab) -> dict[str, object]:
    """``prepare_report.json``: counts, per-split images and every skip with its reason."""
    split_counts = Counter(im.split for im in screen.ok_rows.values())
    skips = [*screen.image_skips, *screen.caption_skips]
    return {
        "images_total": len(src.images),
        "images_ok": len(screen.ok_rows),
        "images_skipped": len(src.images) - len(screen.ok_rows),
        "captions_total": screen.captions_total,
        "captions_kept": len(screen.kept),
        "captions_skipped": screen.captions_total - len(screen.kept),
        "vocab_size": len(vocab),
        **{f"images_{s}": split_counts.get(s, 0) for s in SPLITS},
        "skipped": [{"item": s.item, "reason": s.reason} for s in skips],
    }


def _bad_counts(src: SourceData, screen: _Screen) -> dict[str, tuple[int, int, list[Skip]]]:
    """(bad, considered, skips) for images and captions; excluded items count as neither."""
    excluded_images = sum(s.excluded for s in screen.image_skips)
    excluded_captions = sum(s.excluded for s in screen.caption_skips) + sum(
        screen.status_of[c.image_id].startswith(EXCLUDED) for c in screen.orphans
    )
    bad_captions = screen.captions_total - len(screen.kept) - excluded_captions
    return {
        "images": (
            len(screen.image_skips) - excluded_images,
            len(src.images) - excluded_images,
            screen.image_skips,
        ),
        "captions": (
            bad_captions,
            screen.captions_total - excluded_captions,
            screen.caption_skips,
        ),
    }


def _write_outputs(
    out_dir: Path, images: pa.Table, captions: pa.Table, vocab: Vocab, report: dict[str, object]
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out_dir / IMAGES_FILE, _to_parquet(images))
    write_bytes_atomic(out_dir / CAPTIONS_FILE, _to_parquet(captions))
    save_vocab(vocab, out_dir / VOCAB_FILE)
    text = json.dumps(report, ensure_ascii=False, indent=1) + "\n"
    write_text_atomic(out_dir / REPORT_FILE, text)


def prepare_dataset(
    data: DataConfig, base_dir: Path | None = None, workers: int | None = None
) -> PrepareResult:
    """Run the stage for ``data`` (the ``data`` params section).

    Relative ``data.root`` and ``data.prepared_dir`` resolve against ``base_dir`` (default:
    the current directory, the project root when DVC runs the stage).
    """
    base = (base_dir or Path.cwd()).resolve()
    out_dir = base / data.prepared_dir
    src = read_source(data, out_dir, base, workers)
    return prepare_source(src, data, out_dir, workers)
