"""DVC stage ``prepare``: a caption source -> ``data/prepared/`` (tables, vocab, report).

    python -m pipeline.stages.prepare [--params params.yaml] [-S data.source=flickr8k ...]

Params are loaded and validated before any work, so an unknown key or a wrong type fails at
once. Relative paths resolve against the current directory (the project root under DVC).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.stages import stage_parser
from sat_model.config import ParamsError, load_params
from sat_model.prepare import REPORT_KEYS, PrepareError, prepare_dataset
from sat_model.sources import SourceError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser(__name__, __doc__)
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.overrides)
        result = prepare_dataset(params.data, base_dir=Path.cwd())
    except (ParamsError, PrepareError, SourceError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    summary = {k: result.report[k] for k in REPORT_KEYS}
    print(f"prepare: {json.dumps(summary)} -> {result.prepared_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
