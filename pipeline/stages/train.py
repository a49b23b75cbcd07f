"""DVC stage ``train@<attention>``: features + prepared captions -> ``models/<attention>/``.

By default it trains through Ray Train (``pipeline.ray_train.train_with_ray``: a local Ray with
``ray.num_cpus``, or the cluster at ``ray.address``/``RAY_ADDRESS``), with a Ray and an MLflow run
named after the run's identity (everything it depends on): it trains from epoch 1 unless a run of
that identity finished (nothing to train) or ``--resume`` continues an unfinished one.
``--in-process`` runs the same ``sat_model.train_run.train_model`` in this process with a
progress bar and no Ray or MLflow (debugging, profiling).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.stages import run_locked, stage_parser
from sat_model.config import ATTENTION_KINDS

if TYPE_CHECKING:
    from sat_model.config import Params

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--attention", choices=ATTENTION_KINDS, required=True)
    parser.add_argument("--resume-from", default=None, help="checkpoint folder to continue from")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished Ray run of this exact identity from its last epoch",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--in-process", action="store_true", help="train here, without Ray Train or MLflow"
    )
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from sat_model.config import load_params

    params = load_params(args.params, args.overrides)
    root = Path(args.params).resolve().parent
    return run_locked(
        "train", lambda: _model_dir(params, root, args.attention), lambda: _train(args, params)
    )


def _model_dir(params: Params, root: Path, attention: str) -> Path:
    """``<models_dir>/<attention>``, refused before training if it is not ours to replace."""
    from sat_model.atomic import check_replaceable
    from sat_model.checkpoint import is_checkpoint_dir
    from sat_model.paths import output_path

    model_dir = output_path(params.train.models_dir, root) / attention
    check_replaceable(model_dir, owned=is_checkpoint_dir)
    return model_dir


def _train(args: argparse.Namespace, params: Params) -> int:
    from sat_model.train_run import train_model
    from sat_model.training import ProgressBar

    if not args.in_process:
        from pipeline.ray_train import train_with_ray

        outcome = train_with_ray(
            params,
            args.attention,
            project_root=Path(args.params).resolve().parent,
            address=args.address,
            resume_from=Path(args.resume_from) if args.resume_from else None,
            resume=args.resume,
        )
        print(json.dumps({"model_dir": str(outcome.model_dir), **outcome.metrics}, indent=1))
        return 0
    result = train_model(
        params,
        args.attention,
        prepared_dir=Path(params.data.prepared_dir),
        features_dir=Path(params.encoder.features_dir),
        out_dir=Path(params.train.models_dir),
        callbacks=() if args.no_progress else (ProgressBar(desc=args.attention),),
        resume_from=args.resume_from,
    )
    print(json.dumps({"model_dir": str(result.model_dir), **result.metrics}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
