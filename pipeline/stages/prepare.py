"""DVC stage ``prepare``: a caption source -> ``data/prepared/`` (tables, vocab, report).

    python -m pipeline.stages.prepare [--params params.yaml] [-S data.source=flickr8k ...]

Params are loaded and validated before any work, so an unknown key or a wrong type fails at
once. Relative paths resolve against the project root (the folder of the params file).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence

from pipeline.stages import StageContext, cli_context, finished, stage_parser
from sat_model.data.prepare import PrepareError, prepare_dataset
from sat_model.data.sources import SourceError
from sat_model.data.tables import SPLITS

__all__ = ["main", "run", "summary"]

SKIPPED = ("images_skipped", "captions_skipped")


def main(argv: Sequence[str] | None = None) -> int:
    args = stage_parser(__name__, __doc__).parse_args(argv)
    return run(cli_context("prepare", args))


def run(ctx: StageContext) -> int:
    """Prepare the source ``data`` names; a bad source is one line on stderr and status 1."""
    started = time.perf_counter()
    try:
        result = prepare_dataset(ctx.params.data, base_dir=ctx.root)
    except (PrepareError, SourceError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    finished("prepare", summary(result.report), result.prepared_dir, ctx.root, started)
    return 0


def summary(report: Mapping[str, object]) -> str:
    """``5750 images (train 5000, val 250, test 500), 28750 captions, 53 words``, with what was
    skipped when anything was (the reasons are in ``prepare_report.json``)."""
    splits = ", ".join(f"{s} {report[f'images_{s}']}" for s in SPLITS if report[f"images_{s}"])
    text = f"{report['images_ok']} images ({splits}), {report['captions_kept']} captions"
    skipped = [f"{report[k]} {k.split('_')[0]}" for k in SKIPPED if report[k]]
    if skipped:
        text += f", skipped {' and '.join(skipped)} (prepare_report.json says why)"
    return f"{text}, {report['vocab_size']} words"


if __name__ == "__main__":
    raise SystemExit(main())
