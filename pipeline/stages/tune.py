"""On-demand DVC stage ``tune`` and ``sat tune``: a Ray Tune sweep -> ``best_params.yaml``.

``main(["--params", "params.yaml", "-S", "tune.num_samples=4", "--address", "ray://head:10001"])``
runs :func:`pipeline.tune.run_tune`; relative paths in params resolve against the folder of the
params file (the project root).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pipeline.stages import stage_parser

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from pipeline.tune import run_tune
    from sat_model.config import load_params

    params = load_params(args.params, args.overrides)
    outcome = run_tune(params, address=args.address, project_root=Path(args.params).parent)
    print(f"best params written to {outcome.best_params_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
