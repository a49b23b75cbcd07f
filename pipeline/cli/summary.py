"""``sat summary``: what ``make run`` ends with, the metrics table of the evaluated models, the
champion, what the models know and how to caption an image with the champion."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipeline.cli.commands import CommandError, add_command
from sat_model.config import ATTENTION_KINDS

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sat summary``."""
    p = add_command(
        sub,
        "summary",
        summary="print the metrics table of the evaluated models",
        description="The test-split scores of the evaluated models (reports/{soft,hard}/"
        "metrics.json), the registered champion, what the models know and a command that "
        "captions an image with the champion. Reads files only; `make run` ends with it.",
        examples=[
            "sat summary",
            "sat summary --reports profiles/flickr8k/reports  # a dataset profile's run",
        ],
    )
    p.add_argument(
        "--reports",
        default="reports",
        metavar="DIR",
        help="the reports folder of a run; its params.yaml is the one beside it (%(default)s)",
    )
    p.set_defaults(handler=run)


def _champion_line(registry: dict[str, Any]) -> str:
    """The register stage's record (``reports/registry.json``) as one line: which registered
    version is the champion, its attention variant, and its score where this run compared it."""
    champion = registry.get("champion")
    if champion is None:
        return "champion: none"
    line = f"champion: {registry.get('model_name', 'model')} version {champion}"
    attention = registry.get("champion_attention")
    value = None
    for promotion in registry.get("promotions", []):
        if promotion.get("candidate") == champion:
            value = promotion.get("candidate_value")
        elif promotion.get("previous_champion") == champion:
            value = promotion.get("previous_value")
    details = [f"{attention} attention"] if attention else []
    if value is not None:
        details.append(f"{registry.get('metric', 'score')} {value:.4f}")
    return f"{line} ({', '.join(details)})" if details else line


def _table(rows: list[tuple[str, dict[str, float]]]) -> list[str]:
    from sat_model.evaluation.metrics import metric_keys, metric_label
    from sat_model.params import load_plugins

    load_plugins()  # metrics registered outside the repository
    keys = list(metric_keys())
    keys += [k for k in ("pointing_accuracy",) if any(k in m for _, m in rows)]
    # each column headed as the metric registry labels it ("pointing" for the grounding score)
    heads = [metric_label(k) if k != "pointing_accuracy" else "pointing" for k in keys]
    lines = ["model  " + "  ".join(f"{h:>8}" for h in heads)]
    for attention, metrics in rows:
        cells = "  ".join(f"{metrics.get(k, float('nan')):8.4f}" for k in keys)
        lines.append(f"{attention:<6} {cells}")
    return lines


def _try_it(reports: Path, attentions: list[str]) -> list[str]:
    """What the models know (from their checkpoints) and a command captioning an image of the
    project's own data with the champion."""
    from pipeline.cli.notices import example_image, model_source, scenes_notice
    from pipeline.settings import Params, load_params

    params_file = reports.parent / "params.yaml"  # a profile's reports sit beside its params
    root = params_file.resolve().parent
    params = load_params(params_file) if params_file.exists() else Params()
    # a checkpoint older than its data.source record: the params this run was made with
    models = root / params.train.models_dir
    sources = {model_source(models / a) or params.data.source for a in attentions}
    notices = {scenes_notice(s, "these models caption") for s in sources} - {None}
    lines = [f"note: {n}" for n in sorted(str(n) for n in notices)]
    where = "" if root == Path.cwd().resolve() else f" --params {params_file}"
    image = example_image(params, root) or "path/to/image.jpg"
    command = f".venv/bin/sat caption{where} {image} --attention-out attention/"
    return [*lines, f"caption an image:  {command}"]


def run(args: argparse.Namespace) -> int:
    """Print the summary; no evaluated model yet is a :class:`CommandError`."""
    from sat_model.evaluation.reports import METRICS_FILE, REGISTRY_FILE, read_metrics

    reports = Path(args.reports)
    rows = []
    for attention in ATTENTION_KINDS:
        metrics = read_metrics(reports / attention)
        if metrics is not None:
            rows.append((attention, metrics))
    if not rows:
        raise CommandError(
            f"no metrics under {reports}/{{soft,hard}}/{METRICS_FILE} yet: run `make run`"
        )
    lines = _table(rows)
    registry = reports / REGISTRY_FILE
    if registry.exists():
        lines.append(_champion_line(json.loads(registry.read_text(encoding="utf-8"))))
    print("\n".join([*lines, *_try_it(reports, [a for a, _ in rows])]))
    return 0
