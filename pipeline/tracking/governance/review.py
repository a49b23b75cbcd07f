"""A review report: a candidate version beside the champion, as Markdown and HTML.

What a reviewer compares on a pull request, in one page (``sat review``): both versions'
scores side by side with the deltas, the seeds' spread where several seeds ran
(:mod:`~pipeline.tracking.governance.seeds`), the captions both give to the same test
photos (the first ones of the project's test split, by id) with their attention figures
(:class:`~sat_model.evaluation.visualize.AttentionFigures`, as ``sat caption --attention-out``
draws them), and the params that differ. Each model is fetched from the registry and checked
against its recorded sha256, and decodes as it was scored (its ``sat.decoding`` tag).

The page is built once as blocks (a heading, a paragraph, a table whose cells may be figures)
and written twice, ``review.md`` and ``review.html``, so the two never disagree.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from pipeline.tracking.governance.card import spread_line
from pipeline.tracking.governance.seeds import seed_scores
from pipeline.tracking.packaging import DECODING_TAG
from pipeline.tracking.registry import RegistryError, version_of
from pipeline.tracking.runs import ATTENTION_TAG, EXPERIMENT_TAG, GIT_COMMIT_TAG

__all__ = ["HTML_FILE", "MARKDOWN_FILE", "Side", "find_version", "review_photos", "write_review"]

MARKDOWN_FILE = "review.md"
HTML_FILE = "review.html"
# run params that say where or how a run was served or stored, not what the model is
_NOT_COMPARED = ("serve/", "eval.reports_dir", "eval.meteor_timeout_s", "eval.batch_size")


@dataclass(frozen=True)
class Side:
    """One of the two versions compared, as the registry records it."""

    label: str  # "candidate" or "champion"
    version: str
    attention: str
    metrics: Mapping[str, float]
    params: Mapping[str, str]
    decoding: Mapping[str, Any]
    seeds: Mapping[str, Mapping[str, float]]

    @property
    def title(self) -> str:
        return f"version {self.version} ({self.label}, {self.attention})"


@dataclass(frozen=True)
class Figure:
    """A table cell showing a figure (its path relative to the report) under a caption."""

    caption: str
    src: str | None


Cell = str | Figure
Block = tuple[str, Any]  # ("h1" | "h2" | "h3" | "p" | "ul", text or items) | ("table", rows)


def find_version(client: MlflowClient, model_name: str, which: str, metric: str) -> ModelVersion:
    """The version ``which`` names: a number; ``exp:NAME`` or ``commit:SHA`` (the best on
    ``metric`` of the versions a DVC experiment, or a commit, registered: an experiment
    registers without promoting); else an alias (``champion``, ``@champion``)."""
    kind, _, value = which.partition(":")
    if kind not in ("exp", "commit") or not value:
        number, alias = (which, None) if which.isdigit() else (None, which.lstrip("@"))
        return version_of(client, model_name, number, alias)
    tag = EXPERIMENT_TAG if kind == "exp" else GIT_COMMIT_TAG
    found = [
        v
        for v in client.search_model_versions(f"name = '{model_name}'")
        if (v.tags.get(tag) == value if kind == "exp" else v.tags.get(tag, "").startswith(value))
    ]
    if not found:
        raise RegistryError(f"no version of {model_name} was registered from {kind} {value}")

    def rank(v: ModelVersion) -> tuple[float, int]:
        score = client.get_run(v.run_id).data.metrics.get(metric) if v.run_id else None
        return (-math.inf if score is None else score, int(v.version))

    return max(found, key=rank)


def read_side(
    client: MlflowClient, model_name: str, which: str, label: str, metric: str = "bleu_4"
) -> Side:
    """What the registry records of the version ``which`` names (:func:`find_version`)."""
    version = find_version(client, model_name, which, metric)
    if not version.run_id:
        raise RegistryError(f"{model_name} version {version.version} has no run to read")
    run = client.get_run(version.run_id)
    return Side(
        label=label,
        version=str(version.version),
        attention=version.tags.get(ATTENTION_TAG, "?"),
        metrics=dict(run.data.metrics),
        params=dict(run.data.params),
        decoding=json.loads(version.tags.get(DECODING_TAG) or "{}"),
        seeds=seed_scores(client, model_name, str(version.version)),
    )


def review_photos(params: Any, root: Path, count: int) -> list[Path]:
    """The first ``count`` photos of the project's test split, by id: the same for every
    review of the project."""
    from sat_model.data.sources import image_root
    from sat_model.data.tables import IMAGES_FILE, read_images

    table = root / params.data.prepared_dir / IMAGES_FILE
    rows = read_images(table, image_root(params.data, root), "test")
    return sorted((r.path for r in rows if not r.refused), key=lambda p: p.stem)[:count]


def _caption_with(side: Side, model_dir: Path, photos: Sequence[Path], out: Path) -> list[Figure]:
    """Caption ``photos`` with ``side``'s model as it was scored; one figure each in ``out``."""
    from sat_model.captioner import Captioner
    from sat_model.evaluation.visualize import Attended, AttentionFigures

    options = {k: side.decoding[k] for k in ("beam_size", "max_length") if k in side.decoding}
    captioner = Captioner.from_dir(
        model_dir,
        length_penalty=float(side.decoding.get("length_penalty", 1.0)),
        mode=side.decoding.get("mode", "expected"),
        **options,
    )
    cells = []
    title = f"{side.title}: where the model looked for each word"
    with AttentionFigures(out, title, mode=captioner.mode) as figures:
        for found in captioner.caption_files(list(photos)):
            result = found.caption
            if result is None:
                cells.append(Figure(f"error: {found.error}", None))
                continue
            path = figures.add(
                found.path,
                Path(found.path).stem,
                result.crop,
                Attended(
                    result.words, result.alphas, result.grid_h, result.grid_w, result.locations
                ),
            )
            cells.append(Figure(result.text, path.relative_to(out.parent).as_posix()))
    return cells


def _score(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def _scores(a: Side, b: Side) -> list[Block]:
    keys = [k for k in a.metrics if k in b.metrics] or sorted({*a.metrics, *b.metrics})
    rows: list[list[Cell]] = [["metric", a.title, b.title, "delta"]]
    for k in keys:
        x, y = a.metrics.get(k), b.metrics.get(k)
        delta = f"{x - y:+.4f}" if x is not None and y is not None else ""
        rows.append([k, _score(x), _score(y), delta])
    split = a.params.get("eval.split", "?"), b.params.get("eval.split", "?")
    note = f"Scored on the {split[0]} split (candidate) and the {split[1]} split (champion)."
    return [("h2", "Scores"), ("p", note), ("table", rows)]


def _seeds(a: Side, b: Side) -> list[Block]:
    items = []
    for side in (a, b):
        lines = [line for k in side.metrics if (line := spread_line(side.seeds, k))]
        items.append(f"{side.title}: " + ("; ".join(lines) if lines else "one seed ran"))
    return [("h2", "Seeds"), ("ul", items)]


def _params(a: Side, b: Side) -> list[Block]:
    keys = sorted({*a.params, *b.params})
    rows: list[list[Cell]] = [["param", a.title, b.title]]
    for k in keys:
        if k.startswith(_NOT_COMPARED) or a.params.get(k) == b.params.get(k):
            continue
        rows.append([k, a.params.get(k, "(none)"), b.params.get(k, "(none)")])
    if len(rows) == 1:
        return [("h2", "Params that differ"), ("p", "None: the two were trained alike.")]
    return [("h2", "Params that differ"), ("table", rows)]


def _photos(
    a: Side, b: Side, photos: Sequence[Path], figures: Sequence[list[Figure]]
) -> list[Block]:
    rows: list[list[Cell]] = [["photo", a.title, b.title]]
    for photo, x, y in zip(photos, *figures, strict=True):
        rows.append([photo.name, x, y])
    text = f"The first {len(photos)} photos of the test split, by id, captioned by each."
    return [("h2", "Captions and attention"), ("p", text), ("table", rows)]


def write_review(
    client: MlflowClient,
    model_name: str,
    sides: tuple[str, str],
    photos: Sequence[Path],
    out: Path,
    metric: str = "bleu_4",
) -> tuple[Path, Path]:
    """Compare the candidate ``sides[0]`` with ``sides[1]`` (each a version number or an
    alias) into ``out``; returns the Markdown and HTML files."""
    import tempfile

    from pipeline.tracking.model_uri import resolve_model_dir

    a = read_side(client, model_name, sides[0], "candidate", metric)
    against = "champion" if sides[1].lstrip("@") == "champion" else "against"
    b = read_side(client, model_name, sides[1], against, metric)
    if a.version == b.version:
        raise RegistryError(f"{sides[0]} and {sides[1]} are the same version, {a.version}")
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for side in (a, b):
        with tempfile.TemporaryDirectory() as tmp:
            uri = f"models:/{model_name}/{side.version}"
            model_dir = resolve_model_dir(uri, Path(tmp), client.tracking_uri)
            figures.append(_caption_with(side, model_dir, photos, out / f"version-{side.version}"))
    blocks: list[Block] = [
        ("h1", f"Review: {model_name} {a.title} against {b.title}"),
        *_scores(a, b),
        *_seeds(a, b),
        *_photos(a, b, photos, figures),
        *_params(a, b),
    ]
    md, page = out / MARKDOWN_FILE, out / HTML_FILE
    md.write_text(to_markdown(blocks), encoding="utf-8")
    title = f"Review of {model_name} version {a.version}"
    page.write_text(to_html(blocks, title), encoding="utf-8")
    return md, page


def _md_cell(cell: Cell) -> str:
    if isinstance(cell, Figure):
        image = f"<br>![{cell.caption}]({cell.src})" if cell.src else ""
        return f"{cell.caption}{image}".replace("|", "\\|")
    return str(cell).replace("|", "\\|")


def to_markdown(blocks: Sequence[Block]) -> str:
    """The blocks as Markdown (GitHub's tables: what a pull-request comment shows)."""
    lines = []
    for kind, body in blocks:
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + body, ""]
        elif kind == "p":
            lines += [body, ""]
        elif kind == "ul":
            lines += [*(f"- {item}" for item in body), ""]
        else:
            head, *rows = body
            lines.append("| " + " | ".join(map(_md_cell, head)) + " |")
            lines.append("|" + "---|" * len(head))
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines)


def _html_cell(cell: Cell, tag: str) -> str:
    if isinstance(cell, Figure):
        image = f'<br><img src="{html.escape(cell.src)}" alt="">' if cell.src else ""
        return f"<{tag}>{html.escape(cell.caption)}{image}</{tag}>"
    return f"<{tag}>{html.escape(str(cell))}</{tag}>"


def to_html(blocks: Sequence[Block], title: str) -> str:
    """The blocks as one HTML page, figures inline."""
    parts = []
    for kind, body in blocks:
        if kind in ("h1", "h2", "h3", "p"):
            parts.append(f"<{kind}>{html.escape(body)}</{kind}>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in body) + "</ul>")
        else:
            head, *rows = body
            cells = ["<tr>" + "".join(_html_cell(c, "th") for c in head) + "</tr>"]
            cells += ["<tr>" + "".join(_html_cell(c, "td") for c in row) + "</tr>" for row in rows]
            parts.append("<table>" + "".join(cells) + "</table>")
    style = "img{max-width:100%}table{border-collapse:collapse}td,th{border:1px solid #ccc}"
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )
