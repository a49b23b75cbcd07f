"""Regenerate docs/results.md's tables from the files runs and benchmarks write.

Each table of the page sits between markers, ``<!-- results:NAME:start -->`` and
``<!-- results:NAME:end -->``. ``--write`` rebuilds every table whose source files exist here
(a report folder after ``make run``, ``benchmarks/results/*.json`` after a benchmark) and
leaves the others as recorded, so the page holds the newest figure of each kind with the
command, date and machine that produced it.

    python -m pipeline.docs.results           # print the tables this checkout can build
    python -m pipeline.docs.results --write   # rewrite them in docs/results.md (and the guides)

Another page may hold a table the same way: docs/guide/datasets.md the encoder table, from the
registry (:mod:`pipeline.docs.encoders`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.docs.encoders import encoder_table
from sat_model.atomic import write_text_atomic
from sat_model.config import ATTENTION_KINDS
from sat_model.evaluation.metrics import metric_keys, metric_label
from sat_model.evaluation.reports import read_metrics

__all__ = [
    "PAGES",
    "PAPER_TABLE_1",
    "build_sections",
    "quality_table",
    "serving_table",
    "update_page",
]

# the pages with generated tables, each between its markers
PAGES = ("docs/results.md", "docs/guide/datasets.md")

# the paper's Table 1 (BLEU and METEOR in %): dataset, model, BLEU-1..4, METEOR
PAPER_TABLE_1 = (
    ("Flickr8k", "soft", 67, 44.8, 29.9, 19.5, 18.93),
    ("Flickr8k", "hard", 67, 45.7, 31.4, 21.3, 20.30),
    ("Flickr30k", "soft", 66.7, 43.4, 28.8, 19.1, 18.49),
    ("Flickr30k", "hard", 66.9, 43.9, 29.6, 19.9, 18.46),
    ("MS COCO", "soft", 70.7, 49.2, 34.4, 24.3, 23.90),
    ("MS COCO", "hard", 71.8, 50.4, 35.7, 25.0, 23.04),
)
_ENGINES = {
    "mlflow": "MLflow's scoring server",
    "local": "`sat serve`",
    "ray": "`sat serve --engine ray`",
}


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _this_machine() -> str:
    return f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"


def _machine(recorded: Any) -> str:
    """A benchmark's ``machine`` field, whatever its shape, in a few words."""
    if isinstance(recorded, dict):
        cpu = recorded.get("cpu") or recorded.get("platform") or "CPU"
        cores = recorded.get("cores") or recorded.get("cpus")
        return f"{cores} CPUs ({cpu})" if cores else str(cpu)
    return str(recorded) if recorded else _this_machine()


def _provenance(command: str, files: Sequence[Path], machine: str) -> str:
    newest = max(f.stat().st_mtime for f in files)
    day = datetime.fromtimestamp(newest, UTC).date().isoformat()
    return f"`{command}` · {day} · {machine}"


def quality_table(reports: Path, data: str, command: str) -> str | None:
    """Our scores (in %) per attention variant from ``reports/<variant>/metrics.json``; None
    where no variant has a report."""
    read = {a: read_metrics(reports / a) for a in ATTENTION_KINDS}
    found = {a: m for a, m in read.items() if m is not None}
    if not found:
        return None
    keys = metric_keys()
    point = any("pointing_accuracy" in m for m in found.values())
    # as the metric registry labels them, then pointing accuracy where a report has it
    heads = [metric_label(k) for k in keys] + (["pointing"] if point else [])
    lines = [
        "| model | data | " + " | ".join(heads) + " |",
        "|---|---|" + "---|" * len(heads),
    ]
    for attention, m in found.items():
        cells = [_pct(m.get(k)) for k in keys]
        cells += [_pct(m.get("pointing_accuracy"))] if point else []
        lines.append(f"| **sat {attention}** | {data} | " + " | ".join(cells) + " |")
    files = [reports / a / "metrics.json" for a in found]
    return "\n".join(lines) + "\n\n" + _provenance(command, files, _this_machine())


def paper_table() -> str:
    """The paper's Table 1 (BLEU-1..4 and METEOR, test splits)."""
    heads = [metric_label(k) for k in ("bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor")]
    lines = ["| data | model | " + " | ".join(heads) + " |", "|---|---|---|---|---|---|---|"]
    for dataset, model, *scores in PAPER_TABLE_1:
        lines.append(f"| {dataset} | {model} | " + " | ".join(f"{s:g}" for s in scores) + " |")
    return "\n".join(lines)


def serving_table(path: Path) -> str | None:
    """Images/s and latency of each serving engine, from ``bench_serving.py``'s JSON."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    serving = result.get("serving")
    if not serving:
        return None
    lines = ["| engine | images/s | p50 latency | p95 latency |", "|---|---|---|---|"]
    for key, label in _ENGINES.items():
        row = serving.get(key)
        if row:
            lines.append(
                f"| {label} | {row['images_per_s']:.1f} | {row['latency_p50_s']:.2f} s "
                f"| {row['latency_p95_s']:.2f} s |"
            )
    command = "python benchmarks/bench_serving.py"
    return "\n".join(lines) + "\n\n" + _provenance(command, [path], _machine(result.get("machine")))


def batch_table(path: Path) -> str | None:
    """Batch captioning's rates against the encoder's forward pass, from the same JSON."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    batch = result.get("batch_captioning")
    if not batch:
        return None
    encoder = batch["encoder_only_images_per_s"]
    ways = [
        ("the encoder's forward pass alone", encoder),
        ("encoder + beam search on decoded photos", batch["decoded_images_per_s"]),
        ("`sat caption`, one process", batch["one_process_images_per_s"]),
        ("`sat caption --engine ray` (Ray Data, streaming)", batch["ray_data_images_per_s"]),
    ]
    lines = ["| path | images/s | of the forward pass |", "|---|---|---|"]
    lines += [f"| {label} | {rate:.1f} | {rate / encoder:.2f} |" for label, rate in ways]
    command = "python benchmarks/bench_serving.py --only batch"
    return "\n".join(lines) + "\n\n" + _provenance(command, [path], _machine(result.get("machine")))


def build_sections(root: Path) -> dict[str, str]:
    """Every table this checkout has the files for, by marker name."""
    builders: dict[str, Callable[[], str | None]] = {
        "scenes": lambda: quality_table(root / "reports", "generated scenes, test", "make run"),
        "paper": paper_table,
        "serving": lambda: serving_table(root / "benchmarks/results/serving.json"),
        "batch": lambda: batch_table(root / "benchmarks/results/serving.json"),
        "encoders": encoder_table,
    }
    for params in sorted((root / "profiles").glob("*/params.yaml")):
        builders[params.parent.name] = partial(_profile_table, params.parent)
    built = {name: build() for name, build in builders.items()}
    return {name: text for name, text in built.items() if text is not None}


def _profile_table(folder: Path) -> str | None:
    """A dataset profile's scores, on the split its params evaluate."""
    if not any((folder / "reports" / a / "metrics.json").is_file() for a in ATTENTION_KINDS):
        return None
    from pipeline.settings import load_params

    split = load_params(folder / "params.yaml").eval.split
    name = folder.name
    return quality_table(folder / "reports", f"{name}, {split} split", f"make run PROFILE={name}")


def update_page(text: str, sections: dict[str, str]) -> str:
    """``text`` with each section's table set between its markers; a section the page has no
    markers for is left out, a marker pair without a section keeps what it holds."""
    for name, body in sections.items():
        start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
        head, sep, rest = text.partition(start)
        _, sep2, tail = rest.partition(end)
        if sep and sep2:
            text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the page in place")
    parser.add_argument("--page", action="append", help="a page with markers (default: PAGES)")
    parser.add_argument("--root", default=".", help="the project whose outputs are read")
    args = parser.parse_args(argv)
    sections = build_sections(Path(args.root))
    if not args.write:
        print("\n\n".join(f"<!-- {name} -->\n{body}" for name, body in sections.items()))
        return 0
    for page in args.page or PAGES:
        path = Path(page)
        write_text_atomic(path, update_page(path.read_text(encoding="utf-8"), sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
