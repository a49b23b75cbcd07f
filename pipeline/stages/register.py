"""DVC stage ``register``: log and register each evaluated model, then move ``champion``.

    python -m pipeline.stages.register [--params params.yaml] [--out reports/registry.json]

The work is :func:`pipeline.tracking.registration.register_models` (what is logged where, and when
``champion`` moves); this stage writes what happened to ``reports/registry.json``. A tracking
store that stays unreachable after the retries is one line on stderr (credentials redacted) and
exit status 1, local models and reports untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.stages import StageContext, cli_context, finished, stage_parser
from pipeline.tracking.quiet import quiet_mlflow

__all__ = ["main", "run", "summary"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--out", default=None, help="default: <eval.reports_dir>/registry.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    ctx = cli_context("register", args)
    from pipeline.tracking.governance.floor import check_floor
    from sat_model.config import ParamsError

    try:
        check_floor(ctx.params.promotion.floor)
    except ParamsError as e:
        print(f"register: error: {e}", file=sys.stderr)
        return 1
    quiet_mlflow()  # log_model's warnings, INFO lines and progress bars, for every version
    return run(ctx, out=args.out)


def run(ctx: StageContext, *, out: str | Path | None = None) -> int:
    """Register the evaluated models and write the report to ``out``."""
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.registration import register_models
    from sat_model.atomic import write_text_atomic
    from sat_model.evaluation.reports import REGISTRY_FILE

    started = time.perf_counter()
    try:
        report = register_models(ctx.params, ctx.root, ctx.params_file)
    except FileNotFoundError:
        raise  # nothing to register: a local problem, its message is already clear
    except (MlflowException, OSError) as e:  # the tracking store, after with_retries gave up
        return _fail(e)
    path = Path(out) if out else ctx.path(ctx.params.eval.reports_dir) / REGISTRY_FILE
    write_text_atomic(path, json.dumps(report, indent=1) + "\n")
    finished("register", summary(report), path, ctx.root, started)
    return 0


def summary(report: Mapping[str, Any]) -> str:
    """``sat-captioner version 1 (soft), version 2 (hard); champion: version 1 (soft, bleu_4
    0.9068); version 2 not promoted: 0.9022 is below the champion's 0.9068`` from the report."""
    versions = ", ".join(
        f"version {v['version']} ({v['attention']}{', registered before' if v['reused'] else ''})"
        for v in report["versions"]
    )
    champion = report.get("champion")
    text = f"{report['model_name']} {versions}; "
    if champion is None:
        text += "no champion"
    else:
        values = [
            p.get("candidate_value") for p in report["promotions"] if p["candidate"] == champion
        ]
        values += [  # a champion of an earlier run, compared with this run's versions
            p.get("previous_value")
            for p in report["promotions"]
            if p.get("previous_champion") == champion
        ]
        value = next((v for v in values if v is not None), None)
        score = f", {report['metric']} {value:.4f}" if value is not None else ""
        text += f"champion: version {champion} ({report.get('champion_attention')}{score})"
    reused = {v["version"] for v in report["versions"] if v["reused"]}
    for p in report["promotions"]:  # why the others are not the champion, and what would be
        if p["promoted"] or p["candidate"] == champion:
            continue
        if p["candidate"] in reused and "candidate_value" not in p:
            continue  # registered before and not compared (mlflow.promote): nothing new
        text += f"; version {p['candidate']} not promoted: {p['reason']}"
    return text


def _fail(err: BaseException) -> int:
    """Print a tracking failure (retries spent) without the traceback, credentials redacted:
    DVC keeps stage output in logs, and the tracking URI may hold a token."""
    from pipeline.tracking.store import redact

    notes = "; ".join(getattr(err, "__notes__", []))
    print(f"register: error: {redact(str(err))} ({redact(notes)})", file=sys.stderr)
    print(
        "register: local models and reports are unchanged; re-run when the server is up",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
