"""DVC stage ``prepare``: a caption source -> ``data/prepared/`` (tables, vocab, report).

    python -m pipeline.stages.prepare [--params params.yaml] [-S data.source=flickr8k ...]

Params are loaded and validated before any work, so an unknown key or a wrong type fails at
once. Relative paths resolve against the project root (the folder of the params file).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from pipeline.stages import StageContext, cli_context, stage_parser
from sat_model.data.prepare import REPORT_KEYS, PrepareError, prepare_dataset
from sat_model.data.sources import SourceError

__all__ = ["main", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    args = stage_parser(__name__, __doc__).parse_args(argv)
    return run(cli_context("prepare", args))


def run(ctx: StageContext) -> int:
    """Prepare the source ``data`` names; a bad source is one line on stderr and status 1."""
    try:
        result = prepare_dataset(ctx.params.data, base_dir=ctx.root)
    except (PrepareError, SourceError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    summary = {k: result.report[k] for k in REPORT_KEYS}
    print(f"prepare: {json.dumps(summary)} -> {result.prepared_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
