"""DVC stage ``train@<attention>``: features + prepared captions -> ``models/<attention>/``.

By default it trains through Ray Train (``pipeline.ray.train.train_with_ray``: a local Ray with
``ray.num_cpus``, or the cluster at ``ray.address``/``RAY_ADDRESS``), with a Ray and an MLflow run
named after the run's identity (everything it depends on): it trains from epoch 1 unless a run of
that identity finished (nothing to train) or ``--resume`` continues an unfinished one.
``--in-process`` runs the same ``sat_model.train.run.train_model`` in this process with a
progress bar and no Ray or MLflow (debugging, profiling).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.stages import StageContext, cli_context, finished, run_locked, stage_parser
from sat_model.config import ATTENTION_KINDS
from sat_model.evaluation.metrics import metric_label

if TYPE_CHECKING:
    from pipeline.settings import Params

__all__ = ["main", "run", "summary"]


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
    return run(
        cli_context("train", args),
        args.attention,
        resume=args.resume,
        resume_from=Path(args.resume_from) if args.resume_from else None,
        in_process=args.in_process,
        progress=not args.no_progress,
        address=args.address,
    )


def run(
    ctx: StageContext,
    attention: str,
    *,
    resume: bool = False,
    resume_from: Path | None = None,
    in_process: bool = False,
    progress: bool = True,
    address: str | None = None,
) -> int:
    """Train ``attention`` into ``<models_dir>/<attention>`` under the folder's write lock."""
    if in_process:
        train = functools.partial(_train_here, ctx, attention, resume_from, progress)
    else:
        train = functools.partial(_train_on_ray, ctx, attention, resume_from, resume, address)
    return run_locked("train", lambda: _model_dir(ctx.params, ctx.root, attention), train)


def _model_dir(params: Params, root: Path, attention: str) -> Path:
    """``<models_dir>/<attention>``, refused before training if it is not ours to replace."""
    from sat_model.atomic import check_replaceable
    from sat_model.model.checkpoint import is_checkpoint_dir
    from sat_model.paths import output_path

    model_dir = output_path(params.train.models_dir, root) / attention
    check_replaceable(model_dir, owned=is_checkpoint_dir)
    return model_dir


def _train_on_ray(
    ctx: StageContext,
    attention: str,
    resume_from: Path | None,
    resume: bool,
    address: str | None,
) -> int:
    from pipeline.ray.train import train_with_ray

    started = time.perf_counter()
    outcome = train_with_ray(
        ctx.params,
        attention,
        project_root=ctx.root,
        address=address,
        resume_from=resume_from,
        resume=resume,
    )
    finished(f"train@{attention}", summary(outcome.metrics), outcome.model_dir, ctx.root, started)
    return 0


def _train_here(ctx: StageContext, attention: str, resume_from: Path | None, progress: bool) -> int:
    from sat_model.train.progress import ProgressBar
    from sat_model.train.run import TrainFolders, train_model

    params, started = ctx.params, time.perf_counter()
    result = train_model(
        params,
        attention,
        TrainFolders(
            ctx.path(params.data.prepared_dir),
            ctx.path(params.encoder.features_dir),
            ctx.path(params.train.models_dir),
        ),
        callbacks=(ProgressBar(desc=attention),) if progress else (),
        resume_from=resume_from,
    )
    finished(f"train@{attention}", summary(result.metrics), result.model_dir, ctx.root, started)
    return 0


def summary(metrics: Mapping[str, Any]) -> str:
    """``10 epochs, the best 9 (val BLEU-4 0.9068, CIDEr 2.3456)`` from ``train_metrics.json``."""
    text = f"{metrics.get('epochs', '?')} epochs, the best {metrics.get('best_epoch', '?')}"
    keys = [k.removeprefix("best_val_") for k in metrics if k.startswith("best_val_")]
    scores = [f"{metric_label(k)} {metrics[f'best_val_{k}']:.4f}" for k in keys]
    return f"{text} (val {', '.join(scores)})" if scores else text


if __name__ == "__main__":
    raise SystemExit(main())
