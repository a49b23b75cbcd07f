"""On-demand DVC stage ``tune`` and ``sat tune``: a Ray Tune sweep -> ``best_params.yaml``.

``main(["--params", "params.yaml", "-S", "tune.num_samples=4", "--address", "ray://head:10001"])``
runs :func:`pipeline.tune.run_tune`; relative paths in params resolve against the folder of the
params file (the project root). With ``--apply`` the winner is then trained through the pipeline:
``dvc exp run -S <best params>`` in the project root (an experiment; ``dvc exp apply`` keeps it).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.stages import stage_parser

__all__ = ["apply_command", "main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS)")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="then train the winner: dvc exp run -S <best params> in the project root",
    )
    return parser.parse_args(argv)


def apply_command(best: dict[str, float], overrides: Sequence[str]) -> list[str]:
    """The ``dvc exp run`` that trains the winner: the sweep's own non-``tune`` overrides (so
    the winner sees what its trial saw), then the best values."""
    from pipeline.tune import exp_run_command

    command = exp_run_command(best)
    extra = [item for item in overrides if not item.startswith("tune.")]
    extra = [item for item in extra if item.partition("=")[0] not in best]
    return command[:3] + [part for item in extra for part in ("-S", item)] + command[3:]


def _dvc() -> str:
    """The ``dvc`` of this environment (beside its Python), else the one on PATH."""
    local = Path(sys.executable).parent / "dvc"
    return str(local) if local.exists() else "dvc"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from pipeline.tune import run_tune
    from sat_model.config import load_params

    params = load_params(args.params, args.overrides)
    root = Path(args.params).parent
    outcome = run_tune(params, address=args.address, project_root=root)
    print(f"best params written to {outcome.best_params_file}")
    if not args.apply:
        return 0
    command = apply_command(outcome.best_params, args.overrides)
    print(f"training the winner: {shlex.join(command)}", flush=True)
    return subprocess.run([_dvc(), *command[1:]], cwd=root, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
