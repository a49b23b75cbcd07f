"""Fill docs/EXPERIMENTS.md's results section from ``reports/`` beside the paper's Table 1.

python -m pipeline.docs.results           # print the section
python -m pipeline.docs.results --write   # rewrite docs/EXPERIMENTS.md between the results markers
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from sat_model.atomic import write_text_atomic
from sat_model.config import ATTENTION_KINDS
from sat_model.evaluation.metrics import metric_keys
from sat_model.evaluation.reports import read_metrics

__all__ = ["PAPER_TABLE_1", "results_section"]

START, END = "<!-- results:start -->", "<!-- results:end -->"
# docs/METHOD.md, Table 1 (BLEU and METEOR in %): dataset, model, BLEU-1..4, METEOR
PAPER_TABLE_1 = (
    ("Flickr8k", "soft", 67, 44.8, 29.9, 19.5, 18.93),
    ("Flickr8k", "hard", 67, 45.7, 31.4, 21.3, 20.30),
    ("Flickr30k", "soft", 66.7, 43.4, 28.8, 19.1, 18.49),
    ("Flickr30k", "hard", 66.9, 43.9, 29.6, 19.9, 18.46),
    ("MS COCO", "soft", 70.7, 49.2, 34.4, 24.3, 23.90),
    ("MS COCO", "hard", 71.8, 50.4, 35.7, 25.0, 23.04),
)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


# how the table heads the registered metrics' keys (others: the key in capitals)
_LABELS = {f"bleu_{n}": f"BLEU-{n}" for n in range(1, 5)} | {
    "meteor": "METEOR",
    "rouge_l": "ROUGE-L",
    "cider": "CIDEr",
}


def results_section(reports: Path) -> str:
    """Markdown: our scores (in %) per attention type, then the paper's Table 1."""
    keys = metric_keys()
    heads = [_LABELS.get(k, k.upper()) for k in keys] + ["point"]
    lines = [
        "## Results on the default data",
        "",
        "Test split of the generated scenes, beam search, scored with pycocoevalcap's own "
        "scorers (in %; pointing accuracy: share of object words whose attention peak lies in "
        "that object's box). Written by `python -m pipeline.docs.results --write` from "
        "`reports/` after `make run`.",
        "",
        "| data | model | " + " | ".join(heads) + " |",
        "|---|---|" + "---|" * len(heads),
    ]
    for attention in ATTENTION_KINDS:
        m = read_metrics(reports / attention)
        if m is None:
            continue
        cells = [_pct(m.get(k)) for k in keys] + [_pct(m.get("pointing_accuracy"))]
        lines.append(f"| generated scenes | {attention} | " + " | ".join(cells) + " |")
    for dataset, model, *scores in PAPER_TABLE_1:  # the paper gives BLEU-1..4 and METEOR
        cells = [f"{s:g}" for s in scores] + ["–"] * (len(heads) - len(scores))
        lines.append(f"| {dataset} (paper) | {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_between(text: str, start: str, end: str, body: str) -> str:
    """Return ``text`` with what lies between the ``start`` and ``end`` markers set to ``body``."""
    head, sep, rest = text.partition(start)
    _, sep2, tail = rest.partition(end)
    if not (sep and sep2):
        raise ValueError(f"the file lacks the markers {start} ... {end}")
    return f"{head}{start}\n{body}\n{end}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the page in place")
    parser.add_argument("--readme", default="docs/EXPERIMENTS.md")
    parser.add_argument("--reports", default="reports")
    args = parser.parse_args(argv)
    section = results_section(Path(args.reports))
    if not args.write:
        print(section)
        return 0
    path = Path(args.readme)
    write_text_atomic(path, replace_between(path.read_text(encoding="utf-8"), START, END, section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
