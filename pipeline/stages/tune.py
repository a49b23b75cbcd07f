"""On-demand DVC stage ``tune`` and ``sat tune``: a Ray Tune sweep -> ``best_params.yaml``.

``main(["--params", "params.yaml", "-S", "tune.num_samples=4", "--address", "head:6379"])``
runs :func:`pipeline.ray.tune.run_tune`; relative paths in params resolve against the project root
(the folder of the params file). With ``--apply`` the winner is then trained through the pipeline:
``dvc exp run -S <best params>`` in the project root (an experiment; ``dvc exp apply`` keeps it).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.stages import StageContext, cli_context, stage_parser

__all__ = ["apply_command", "main", "run"]


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
    from pipeline.ray.tune import exp_run_command

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
    return run(cli_context("tune", args), address=args.address, apply=args.apply)


def run(ctx: StageContext, *, address: str | None = None, apply: bool = False) -> int:
    """The sweep; with ``apply``, ``dvc exp run`` of the winner in the project root."""
    from pipeline.ray.tune import run_tune

    outcome = run_tune(ctx.params, address=address, project_root=ctx.root)
    print(f"best params written to {outcome.best_params_file}")
    if not apply:
        return 0
    command = apply_command(outcome.best_params, ctx.overrides)
    print(f"training the winner: {shlex.join(command)}", flush=True)
    return subprocess.run([_dvc(), *command[1:]], cwd=ctx.root, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
