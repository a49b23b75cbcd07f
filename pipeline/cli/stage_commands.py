"""``sat train``, ``sat tune`` and ``sat evaluate``: a pipeline stage run by hand, outside DVC.

Each builds the stage context from ``--params``/``-S`` and calls the stage's ``run``, as its DVC
entry does. What they write stays out of DVC's way: ``sat train`` refuses to replace a folder a
DVC stage tracks (and says how to train through DVC or beside it), and ``sat evaluate`` writes
its report beside a tracked one (``reports/eval/<name>``) unless ``--out`` names another folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli.commands import CommandError, add_command
from pipeline.cli.project import context, use_mlflow
from pipeline.stages import StageContext, add_params_args, evaluate
from sat_model.config import ATTENTION_KINDS

__all__ = ["add_parsers"]


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster: a dashboard URL (http://head:8265) submits this command as a Ray Job; "
        "a GCS address (head:6379) or auto connects from here (default: RAY_ADDRESS)",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``sat train``, ``sat tune`` and ``sat evaluate``."""
    _add_train(sub)
    _add_tune(sub)
    _add_evaluate(sub)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "train",
        summary="train one model (soft or hard attention) through Ray Train",
        description="Train one model on the prepared data and features, logged to MLflow, "
        "into <train.models_dir>/<attention>. A folder that a DVC stage writes (models/soft "
        "in this repository) is refused: train through DVC (`dvc exp run -S ...`) or set "
        "another train.models_dir.",
        examples=[
            "sat train --attention soft -S train.models_dir=models/try -S train.soft.lr=2e-3",
            "sat train --attention hard --address http://head:8265  # as a Ray Job",
        ],
    )
    add_params_args(p)
    p.add_argument("--attention", choices=ATTENTION_KINDS, required=True, help="the variant")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished run of this exact identity from its last epoch",
    )
    _add_address(p)
    p.set_defaults(handler=_train)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "tune",
        summary="Ray Tune sweep; each trial an MLflow child run",
        description="A hyperparameter sweep over the search space of the tune section "
        "(Optuna TPE + ASHA on Ray Tune), each trial an MLflow child run; the best params go "
        "to reports/tune/best_params.yaml.",
        examples=["sat tune", "sat tune --apply  # then train the winner with dvc exp run -S"],
    )
    add_params_args(p)
    _add_address(p)
    p.add_argument("--apply", action="store_true", help="then train the winner (dvc exp run -S)")
    p.set_defaults(handler=_tune)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "evaluate",
        summary="the evaluate stage on any model folder or URI and split",
        description="Caption a split with a model, score it (BLEU, METEOR, ROUGE-L, CIDEr) and "
        "draw its attention gallery. The report goes to --out, by default reports/eval/<model "
        "name>: never over a folder a DVC stage writes (reports/soft, reports/hard).",
        examples=[
            "sat evaluate --model models:/sat-captioner@champion --split val",
            "sat evaluate --model models/hard --out reports/try",
        ],
    )
    add_params_args(p)
    evaluate.add_arguments(p)
    p.set_defaults(handler=_evaluate)


def _forward_params(args: argparse.Namespace) -> list[str]:
    """``--params`` (absolute: the job opens it where the driver has it) and ``-S`` flags."""
    out = ["--params", str(Path(args.params).resolve())]
    for item in args.overrides:
        out += ["-S", item]
    return out


def _as_ray_job(args: argparse.Namespace, command: list[str]) -> int | None:
    """With a dashboard URL (``--address http://...`` or ``RAY_ADDRESS``): run ``sat <command>``
    as a Ray Job on that cluster and return its status; None: run here (pipeline.ray.jobs).
    The params were loaded here first: a bad one is one line here, not a failed job."""
    from pipeline.ray.jobs import job_address

    address = job_address(args.address)
    if address is None:
        return None
    from pipeline.ray.jobs import run_as_job

    # the job opens the params file (and the data it names) at this absolute path: shared folder
    verbose = ["-v"] * int(args.verbose or 0)  # the job's traceback, not its one line
    command = [command[0], *verbose, *_forward_params(args), *command[1:]]
    return run_as_job(address, command, quiet=not args.verbose)


def _through_dvc(args: argparse.Namespace, stage: str) -> str:
    """The DVC command that runs ``stage`` with this command's ``-S`` overrides."""
    if not args.overrides:
        return f"dvc repro {stage}"
    # a profile's stage is named with its dvc.yaml, and its params file precedes each key
    prefix, target = (f"{args.params}:", f" {stage}") if ":" in stage else ("", "")
    return "dvc exp run" + "".join(f" -S {prefix}{o}" for o in args.overrides) + target


def _refuse_dvc_output(ctx: StageContext, args: argparse.Namespace) -> None:
    """:class:`CommandError` when ``sat train`` would replace the output of a DVC stage."""
    from pipeline.cli.dvc_outputs import stage_writing
    from sat_model.paths import output_path

    model_dir = output_path(ctx.params.train.models_dir, ctx.root) / args.attention
    stage = stage_writing(model_dir)
    if stage is None:
        return
    params = "" if args.params == "params.yaml" else f" --params {args.params}"
    overrides = "".join(f" -S {o}" for o in args.overrides)
    beside = (
        f"sat train{params} --attention {args.attention}{overrides} -S train.models_dir=models/try"
    )
    raise CommandError(
        f"{_shown(model_dir)} is the output of DVC stage {stage}: sat train will not replace "
        f"it behind DVC's back. Train it through DVC ({_through_dvc(args, stage)}), or into "
        f"another folder ({beside})"
    )


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it."""
    cwd = Path.cwd().resolve()
    return str(path.relative_to(cwd) if path.is_relative_to(cwd) else path)


def _train(args: argparse.Namespace) -> int:
    ctx = context(args)
    _refuse_dvc_output(ctx, args)
    from pipeline.stages import train

    resume = ["--resume"] if args.resume else []
    submitted = _as_ray_job(args, ["train", "--attention", args.attention, *resume])
    if submitted is not None:
        return submitted
    return train.run(ctx, args.attention, resume=args.resume, address=args.address)


def _tune(args: argparse.Namespace) -> int:
    ctx = context(args)
    from pipeline.stages import tune

    submitted = _as_ray_job(args, ["tune", *(["--apply"] if args.apply else [])])
    if submitted is not None:
        return submitted
    return tune.run(ctx, address=args.address, apply=args.apply)


def _evaluate_out(ctx: StageContext, args: argparse.Namespace) -> str | None:
    """Where ``sat evaluate`` writes: ``--out`` unless a DVC stage writes it (refused), else
    the stage's default unless a DVC stage writes that (then ``reports/eval/<attention>``)."""
    from pipeline.cli.dvc_outputs import stage_writing
    from sat_model.paths import output_path

    if args.out is not None:
        stage = stage_writing(Path(args.out).resolve())
        if stage is not None:
            raise CommandError(
                f"--out {args.out} is the output of DVC stage {stage}: sat evaluate will not "
                f"replace it behind DVC's back; run `dvc repro {stage}`, or name another folder"
            )
        return str(args.out)

    def out_for(model: str | None) -> Path:
        reports = evaluate.default_out_dir(ctx.params.eval.reports_dir, args.attention, model)
        return output_path(str(reports), ctx.root)

    default = out_for(args.model)
    stage = stage_writing(default)
    if stage is None:
        return None
    beside = out_for(f"{ctx.params.train.models_dir}/{args.attention}")  # reports/eval/soft
    print(
        f"sat evaluate: {_shown(default)} is the output of DVC stage {stage} (`dvc repro "
        f"{stage}` writes it); this report goes to {_shown(beside)}",
        file=sys.stderr,
    )
    return str(beside)


def _evaluate(args: argparse.Namespace) -> int:
    from pipeline.tracking.model_uri import is_model_uri

    ctx = context(args)
    out = _evaluate_out(ctx, args)
    if args.model and is_model_uri(args.model):
        use_mlflow(args)  # no MLflow progress bar over the download
    return evaluate.run(ctx, args.attention, model=args.model, split=args.split, out=out)
