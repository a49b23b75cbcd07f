"""The ``sat`` command: one subcommand per user task.

Each subcommand is a thin handler that imports what it needs inside the function, so that
``sat --help`` stays fast and a handler's heavy dependencies (Ray, MLflow, torch) load only when
that handler runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.stages import add_params_args

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _forward_params(args: argparse.Namespace) -> list[str]:
    out = ["--params", args.params]
    for item in args.overrides:
        out += ["-S", item]
    return out


# ----------------------------------------------------------------------------- summary
def _summary(args: argparse.Namespace) -> int:
    """Print the metrics table of the evaluated models and how to caption an image."""
    reports = Path(args.reports)
    rows = []
    for attention in ("soft", "hard"):
        path = reports / attention / "metrics.json"
        if path.exists():
            rows.append((attention, json.loads(path.read_text())))
    if not rows:
        print(f"no metrics under {reports}/{{soft,hard}}/metrics.json yet: run `dvc repro`")
        return 1
    keys = ["bleu_1", "bleu_2", "bleu_3", "bleu_4", "meteor", "rouge_l", "cider"]
    keys += [k for k in ("pointing_accuracy",) if any(k in m for _, m in rows)]
    print("model  " + "  ".join(f"{k:>8}" for k in keys))
    for attention, metrics in rows:
        cells = "  ".join(f"{metrics.get(k, float('nan')):8.4f}" for k in keys)
        print(f"{attention:<6} {cells}")
    registry = reports / "registry.json"
    if registry.exists():
        info = json.loads(registry.read_text())
        print(f"champion: {info.get('champion')}")
    print("caption an image:  .venv/bin/sat caption path/to/image.jpg --attention-out overlays/")
    return 0


# ------------------------------------------------------------------------------- train
def _train(args: argparse.Namespace) -> int:
    from pipeline.stages import train

    return train.main([*_forward_params(args), "--attention", args.attention]) or 0


# -------------------------------------------------------------------------------- tune
def _tune(args: argparse.Namespace) -> int:
    from pipeline.stages import tune

    extra = ["--address", args.address] if args.address else []
    extra += ["--apply"] if args.apply else []
    return tune.main([*_forward_params(args), *extra]) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sat", description="Show, Attend and Tell: train, tune, evaluate, serve."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("summary", help="print the metrics table of the evaluated models")
    p.add_argument("--reports", default="reports")
    p.set_defaults(handler=_summary)

    p = sub.add_parser("train", help="train one model (soft or hard attention) through Ray Train")
    add_params_args(p)
    p.add_argument("--attention", choices=["soft", "hard"], required=True)
    p.set_defaults(handler=_train)

    p = sub.add_parser("tune", help="Ray Tune sweep; each trial an MLflow child run")
    add_params_args(p)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS)")
    p.add_argument("--apply", action="store_true", help="then train the winner (dvc exp run -S)")
    p.set_defaults(handler=_tune)

    # evaluation, registry and captioning commands are added by _register_more below
    _register_more(sub)
    return parser


# ------------------------------------------------- caption, models, promote, evaluate
def _params_or_defaults(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    # outside a project (no params.yaml) the defaults and MLFLOW_TRACKING_URI still work
    from sat_model.config import Params, load_params

    if not Path(args.params).exists() and not args.overrides:
        return Params()
    return load_params(args.params, args.overrides)


def _mlflow_cfg(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    return _params_or_defaults(args).mlflow


def _tracking_uri(args: argparse.Namespace) -> str:
    from pipeline.tracking import resolve_tracking_uri

    return resolve_tracking_uri(_mlflow_cfg(args), Path.cwd())


def _model_name(args: argparse.Namespace) -> str:
    return args.name or _mlflow_cfg(args).model_name


def _caption(args: argparse.Namespace) -> int:
    """Caption each image; a bad image gets its own message and the others still run."""
    import tempfile

    from pipeline.stages.evaluate import resolve_model_dir
    from sat_model.captioner import Captioner, decode_image_input
    from sat_model.images import ImageError
    from sat_model.visualize import write_word_overlays

    model = args.model or f"models:/{_model_name(args)}@champion"
    with tempfile.TemporaryDirectory() as tmp:
        uri = None if Path(model).exists() else _tracking_uri(args)
        ev = _params_or_defaults(args).eval
        captioner = Captioner.from_dir(
            resolve_model_dir(model, Path(tmp), uri),
            beam_size=ev.beam_size,
            max_length=ev.max_length,
            length_normalization=ev.length_normalization,
            mode=ev.hard_decode,
        )
    ok = 0
    for path in args.images:
        try:
            image = decode_image_input(Path(path))
        except ImageError as e:
            print(f"{path}: error: {e.reason}", file=sys.stderr)
            continue
        (result,) = captioner.caption([image], args.beam_size)
        print(f"{path}: {result.text}")
        ok += 1
        if args.attention_out:
            write_word_overlays(
                result.crop, result.words, result.alphas, grid_h=result.grid_h,
                grid_w=result.grid_w, out_dir=args.attention_out, stem=Path(path).stem,
            )  # fmt: skip
    return 0 if ok else 1


def _models(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    from pipeline.registry import list_versions

    rows = list_versions(MlflowClient(_tracking_uri(args)), _model_name(args))
    if not rows:
        print(f"no registered version of {_model_name(args)!r}")
        return 1
    print(f"{'version':>7}  {'attention':<9} {'bleu_4':>7} {'meteor':>7} {'cider':>7}  aliases")
    for r in rows:
        cells = " ".join(
            f"{r.metrics.get(k, float('nan')):7.4f}" for k in ("bleu_4", "meteor", "cider")
        )
        print(f"{r.version:>7}  {r.attention or '-':<9} {cells}  {','.join(r.aliases)}")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    from pipeline.registry import RegistryError, promote

    metric = args.metric or _mlflow_cfg(args).champion_metric
    try:
        out = promote(MlflowClient(_tracking_uri(args)), _model_name(args), metric, args.version)
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    moved = "moved" if out.promoted else "stays"
    print(
        f"champion {moved}: {out.model_name} version {out.champion} "
        f"({metric} {out.candidate_value}); previously {out.previous_champion} ({out.reason})"
    )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from pipeline.stages import evaluate

    extra = ["--attention", args.attention]
    for flag, value in (("--model", args.model), ("--split", args.split), ("--out", args.out)):
        extra += [flag, value] if value else []
    return evaluate.main([*_forward_params(args), *extra]) or 0


def _register_more(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Subcommands for evaluation, the registry and captioning (caption, models, promote...)."""
    p = sub.add_parser("caption", help="caption image files; write per-word attention overlays")
    add_params_args(p)
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--model", default=None, help="models:/NAME@ALIAS URI or a model folder "
                   "(default: models:/<mlflow.model_name>@champion)")  # fmt: skip
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--beam-size", type=int, default=None)
    p.add_argument("--attention-out", default=None, metavar="DIR")
    p.set_defaults(handler=_caption)

    p = sub.add_parser("models", help="registered versions with metrics and aliases")
    add_params_args(p)
    p.add_argument("--name", default=None, help="registered model (default: mlflow.model_name)")
    p.set_defaults(handler=_models)

    p = sub.add_parser("promote", help="move the champion alias to the best (or named) version")
    add_params_args(p)
    p.add_argument("--name", default=None, help="registered model (default: mlflow.model_name)")
    p.add_argument("--metric", default=None, help="default: mlflow.champion_metric")
    p.add_argument("--version", default=None)
    p.set_defaults(handler=_promote)

    p = sub.add_parser("evaluate", help="the evaluate stage on any model folder or URI and split")
    add_params_args(p)
    p.add_argument("--model", default=None, help="model folder or models:/ URI")
    p.add_argument("--attention", choices=["soft", "hard"], default="soft")
    p.add_argument("--split", default=None)
    p.add_argument("--out", default=None, help="report folder")
    p.set_defaults(handler=_evaluate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
