"""The ``sat`` command: one subcommand per user task.

Each subcommand is a thin handler that imports what it needs inside the function, so that
``sat --help`` stays fast and a handler's heavy dependencies (Ray, MLflow, torch) load only when
that handler runs.

A user error (bad params, a missing model or file, an unusable input, a tracking store that does
not answer) ends with one line ``sat <command>: error: ...`` on stderr and exit status 1; ``-v``
shows the traceback instead, and MLflow's warnings and download progress bars, which ``sat``
otherwise keeps quiet. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipeline.serving import command as serve
from pipeline.stages import StageContext, add_params_args, evaluate, load_context, project_root
from pipeline.stages.user_errors import is_user_error, one_line
from pipeline.tracking.quiet import quiet_mlflow
from sat_model.config import ATTENTION_KINDS

__all__ = ["CommandError", "main"]

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user error found by a ``sat`` command; its message is the line ``sat`` prints."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _context(args: argparse.Namespace) -> StageContext:
    """The stage context of ``--params``/``-S``, as the DVC entry of every stage builds it."""
    return load_context(args.params, args.overrides)


def _forward_params(args: argparse.Namespace) -> list[str]:
    """``--params`` (absolute: the job opens it where the driver has it) and ``-S`` flags."""
    out = ["--params", str(Path(args.params).resolve())]
    for item in args.overrides:
        out += ["-S", item]
    return out


def _as_ray_job(args: argparse.Namespace, command: list[str]) -> int | None:
    """With a dashboard URL (``--address http://...`` or ``RAY_ADDRESS``): run ``sat <command>``
    as a Ray Job on that cluster and return its status; None: run here (pipeline.ray.jobs)."""
    from pipeline.ray.jobs import job_address

    address = job_address(args.address)
    if address is None:
        return None
    from pipeline.ray.jobs import run_as_job
    from sat_model.config import load_params

    load_params(args.params, args.overrides)  # bad params: one line here, not a failed job
    # the job opens the params file (and the data it names) at this absolute path: shared folder
    verbose = ["-v"] * int(args.verbose or 0)  # the job's traceback, not its one line
    command = [command[0], *verbose, *_forward_params(args), *command[1:]]
    return run_as_job(address, command, quiet=not args.verbose)


# ----------------------------------------------------------------------------- summary
def _champion_line(registry: dict[str, Any]) -> str:
    """The register stage's record (``reports/registry.json``) as one line: which registered
    version is the champion, its attention variant, and its score where this run compared it."""
    champion = registry.get("champion")
    if champion is None:
        return "champion: none"
    line = f"champion: {registry.get('model_name', 'model')} version {champion}"
    attention = registry.get("champion_attention")
    value = None
    for promotion in registry.get("promotions", []):
        if promotion.get("candidate") == champion:
            value = promotion.get("candidate_value")
        elif promotion.get("previous_champion") == champion:
            value = promotion.get("previous_value")
    details = [f"{attention} attention"] if attention else []
    if value is not None:
        details.append(f"{registry.get('metric', 'score')} {value:.4f}")
    return f"{line} ({', '.join(details)})" if details else line


def _summary(args: argparse.Namespace) -> int:
    """Print the metrics table of the evaluated models and how to caption an image."""
    reports = Path(args.reports)
    rows = []
    for attention in ATTENTION_KINDS:
        path = reports / attention / "metrics.json"
        if path.exists():
            rows.append((attention, json.loads(path.read_text())))
    if not rows:
        print(f"no metrics under {reports}/{{soft,hard}}/metrics.json yet: run `dvc repro`")
        return 1
    from sat_model.evaluation.metrics import metric_keys

    keys = list(metric_keys())
    keys += [k for k in ("pointing_accuracy",) if any(k in m for _, m in rows)]
    print("model  " + "  ".join(f"{k:>8}" for k in keys))
    for attention, metrics in rows:
        cells = "  ".join(f"{metrics.get(k, float('nan')):8.4f}" for k in keys)
        print(f"{attention:<6} {cells}")
    registry = reports / "registry.json"
    if registry.exists():
        print(_champion_line(json.loads(registry.read_text())))
    params = reports.parent / "params.yaml"  # a profile's reports sit beside its params file
    where = "" if reports.resolve().parent == Path.cwd() else f" --params {params}"
    command = f".venv/bin/sat caption{where} path/to/image.jpg --attention-out overlays/"
    print(f"caption an image:  {command}")
    return 0


# ------------------------------------------------------------------------------- train
def _train(args: argparse.Namespace) -> int:
    from pipeline.stages import train

    resume = ["--resume"] if args.resume else []
    submitted = _as_ray_job(args, ["train", "--attention", args.attention, *resume])
    if submitted is not None:
        return submitted
    return train.run(_context(args), args.attention, resume=args.resume, address=args.address)


# -------------------------------------------------------------------------------- tune
def _tune(args: argparse.Namespace) -> int:
    from pipeline.stages import tune

    submitted = _as_ray_job(args, ["tune", *(["--apply"] if args.apply else [])])
    if submitted is not None:
        return submitted
    return tune.run(_context(args), address=args.address, apply=args.apply)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=default,
        help="show tracebacks; caption, models, promote: MLflow's logs and progress bars too",
    )


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster: a dashboard URL (http://head:8265) submits this command as a Ray Job; "
        "a GCS address (head:6379) or auto connects from here (default: RAY_ADDRESS)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sat", description="Show, Attend and Tell: train, tune, evaluate, serve."
    )
    parser.add_argument("--version", action="version", version=f"sat {_version()}")
    _add_verbose(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("summary", help="print the metrics table of the evaluated models")
    p.add_argument("--reports", default="reports")
    p.set_defaults(handler=_summary)

    p = sub.add_parser("train", help="train one model (soft or hard attention) through Ray Train")
    add_params_args(p)
    p.add_argument("--attention", choices=ATTENTION_KINDS, required=True)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished run of this exact identity from its last epoch",
    )
    _add_address(p)
    p.set_defaults(handler=_train)

    p = sub.add_parser("tune", help="Ray Tune sweep; each trial an MLflow child run")
    add_params_args(p)
    _add_address(p)
    p.add_argument("--apply", action="store_true", help="then train the winner (dvc exp run -S)")
    p.set_defaults(handler=_tune)

    # evaluation, registry and captioning commands are added by _register_more below
    _register_more(sub)
    _add_profile(sub)
    serve.add_parser(sub)
    # `sat caption -v ...` as well as `sat -v caption ...`; SUPPRESS keeps a -v given before
    # the command when the subcommand's own is absent
    for command in sub.choices.values():
        if "-v" not in command._option_string_actions:
            _add_verbose(command, argparse.SUPPRESS)
    return parser


# ------------------------------------------------- caption, models, promote, evaluate
def _params_or_defaults(args: argparse.Namespace):
    # outside a project (no params.yaml) the defaults and MLFLOW_TRACKING_URI still work
    from sat_model.config import Params, load_params

    if not Path(args.params).exists() and not args.overrides:
        return Params()
    return load_params(args.params, args.overrides)


def _mlflow_cfg(args: argparse.Namespace):
    return _params_or_defaults(args).mlflow


def _tracking_uri(args: argparse.Namespace) -> str:
    from pipeline.tracking.runs import resolve_tracking_uri

    return resolve_tracking_uri(_mlflow_cfg(args), project_root(args.params))


def _model_name(args: argparse.Namespace) -> str:
    return args.name or _mlflow_cfg(args).model_name


NO_CHAMPION = (
    "no champion model registered as {uri} (tracking store {store}): run `make run`, "
    "or pass --model models/soft"
)


def _caption_model_dir(args: argparse.Namespace, workdir: Path) -> Path:
    """The model folder to caption with: ``--model`` as a folder, or a downloaded MLflow model
    (by default the champion); a missing model is a :class:`CommandError`."""
    from pipeline.tracking.model_uri import is_model_uri, resolve_model_dir

    model = args.model or f"models:/{_model_name(args)}@champion"
    if not is_model_uri(model):
        if not (Path(model) / "model.pt").is_file():
            raise CommandError(f"{model} is not a model folder (no model.pt in it)")
        return Path(model)
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.runs import redact

    uri = _tracking_uri(args)
    missing = CommandError(NO_CHAMPION.format(uri=model, store=redact(uri)))
    # an absent SQLite store holds no model: say so before MLflow creates an empty one here
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise missing
    try:
        return resolve_model_dir(model, workdir, uri)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise missing from e
        raise


def _caption_device(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda: no CUDA device is available here")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _print_caption(found, fmt: str, figures) -> None:
    from tqdm import tqdm

    result = found.caption
    if fmt == "jsonl":
        row = {"path": found.path, "caption": result.text if result else None, "error": found.error}
        tqdm.write(json.dumps(row), file=sys.stdout)
    elif result is None:
        tqdm.write(f"{found.path}: error: {found.error}", file=sys.stderr)
    else:
        tqdm.write(f"{found.path}: {result.text}", file=sys.stdout)
    if result is not None and figures is not None:  # --attention-out
        figures.add(
            found.path,
            Path(found.path).stem,
            result.crop,
            result.words,
            result.alphas,
            grid_h=result.grid_h,
            grid_w=result.grid_w,
        )


def _attention_figures(folder: str | None, mode: str) -> Any:
    """``--attention-out``: a figure per image and ``index.html`` (written when captioning ends)."""
    from sat_model.evaluation.visualize import AttentionFigures

    if not folder:
        return None
    return AttentionFigures(folder, "sat caption: where the model looked for each word", mode=mode)


def _captioner_options(ev: Any, batch_size: int) -> dict[str, Any]:
    """How ``sat caption`` decodes: the project's eval section (as the evaluate stage scores)."""
    return {
        "beam_size": ev.beam_size,
        "max_length": ev.max_length,
        "batch_size": batch_size,
        "length_penalty": ev.length_penalty.model_dump(),
        "mode": ev.hard_decode,
    }


def _caption_on_ray(args: argparse.Namespace) -> int:
    """``sat caption SOURCE --engine ray --out DEST``: Ray Data over a folder or a bucket."""
    import tempfile

    from pipeline.ray.caption import caption_with_ray_data
    from pipeline.ray.runtime import ray_session

    if len(args.inputs) != 1 or not args.out:
        raise CommandError("--engine ray captions one folder or bucket prefix into --out DEST")
    if args.attention_out:
        raise CommandError("--attention-out is for the local engine")
    source = args.inputs[0]
    if "://" not in source:
        if not Path(source).is_dir():
            raise CommandError(f"{source} is not a folder (or an s3:// prefix)")
        source = str(Path(source).resolve())  # Ray's workers run elsewhere
    out = args.out if "://" in args.out else str(Path(args.out).resolve())
    params = _params_or_defaults(args)
    options = _captioner_options(params.eval, args.batch_size)
    if args.beam_size:
        options["beam_size"] = args.beam_size
    with tempfile.TemporaryDirectory() as tmp, ray_session(params.ray, address=args.address):
        result = caption_with_ray_data(
            source,
            out,
            _caption_model_dir(args, Path(tmp)),
            options,
            max_pixels=params.encoder.max_image_pixels,
            fmt="parquet" if args.format == "parquet" else "jsonl",
            actors=args.actors,
        )
    print(f"captioned {result.rows - result.errors} of {result.rows} images into {result.out}")
    if result.errors:
        print(f"{result.errors} could not be captioned: their rows say why", file=sys.stderr)
    return 0 if result.rows > result.errors else 1


def _caption(args: argparse.Namespace) -> int:
    """Caption image files and folders in batches; a bad image gets its own error, the others
    still run; exit 1 when no image could be captioned."""
    import tempfile
    from contextlib import nullcontext

    from tqdm import tqdm

    from sat_model.captioner import Captioner, find_image_files

    if args.engine == "ray":
        return _caption_on_ray(args)
    if args.out:
        raise CommandError("--out is for --engine ray; here captions go to stdout")
    paths = find_image_files(args.inputs)
    if not paths:
        raise CommandError(f"no image files in {' '.join(args.inputs)}")
    params = _params_or_defaults(args)
    with tempfile.TemporaryDirectory() as tmp:
        captioner = Captioner.from_dir(
            _caption_model_dir(args, Path(tmp)),
            device=_caption_device(args.device),
            **_captioner_options(params.eval, args.batch_size),
        )
    # a bar only where someone watches (a terminal) and only when there is more than one batch
    bar = tqdm(
        total=len(paths),
        unit="image",
        file=sys.stderr,
        leave=False,
        disable=None if len(paths) > args.batch_size else True,
    )
    figures = _attention_figures(args.attention_out, captioner.mode)
    ok = 0
    with bar, nullcontext() if figures is None else figures:
        for found in captioner.caption_files(
            paths,
            beam_size=args.beam_size,
            max_pixels=params.encoder.max_image_pixels,
            workers=args.workers,
        ):
            _print_caption(found, args.format, figures)
            ok += found.caption is not None
            bar.update()
    return 0 if ok else 1


def _models(args: argparse.Namespace) -> int:
    from mlflow import MlflowClient

    from pipeline.tracking.registry import list_versions

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

    from pipeline.tracking.registry import RegistryError, promote

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
    ctx = _context(args)
    return evaluate.run(ctx, args.attention, model=args.model, split=args.split, out=args.out)


def _register_more(sub: argparse._SubParsersAction) -> None:
    """Subcommands for evaluation, the registry and captioning (caption, models, promote...)."""
    _add_caption(sub)

    p = sub.add_parser("models", help="registered versions with metrics and aliases")
    add_params_args(p)
    p.add_argument("--name", default=None, help="registered model (default: mlflow.model_name)")
    p.set_defaults(handler=_models, quiet=True)

    p = sub.add_parser("promote", help="move the champion alias to the best (or named) version")
    add_params_args(p)
    p.add_argument("--name", default=None, help="registered model (default: mlflow.model_name)")
    p.add_argument("--metric", default=None, help="default: mlflow.champion_metric")
    p.add_argument("--version", default=None)
    p.set_defaults(handler=_promote, quiet=True)

    p = sub.add_parser("evaluate", help="the evaluate stage on any model folder or URI and split")
    add_params_args(p)
    evaluate.add_arguments(p)
    p.set_defaults(handler=_evaluate)


def _add_caption_on_ray(p: argparse.ArgumentParser) -> None:
    """``sat caption --engine ray``'s options."""
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process (default); ray: Ray Data over one folder or s3:// prefix, "
        "an actor pool holding the model, rows written to --out",
    )
    p.add_argument(
        "--out", default=None, metavar="DEST", help="with --engine ray: a folder or s3://"
    )
    p.add_argument(
        "--address",
        default=None,
        help="with --engine ray: the Ray cluster (default: ray.address, RAY_ADDRESS, else local)",
    )
    p.add_argument(
        "--actors",
        type=_positive_int,
        default=1,
        help="with --engine ray: model copies (%(default)s)",
    )


def _add_caption(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("caption", help="caption image files and folders; attention figures")
    add_params_args(p)
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="IMAGE_OR_FOLDER",
        help="image files, and folders searched recursively for image files",
    )
    p.add_argument(
        "--model",
        default=None,
        help="models:/NAME@ALIAS URI or a model folder "
        "(default: models:/<mlflow.model_name>@champion)",
    )
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--format",
        choices=["text", "jsonl", "parquet"],
        default="text",
        help="text: 'path: caption' lines; jsonl: one {path, caption, error} per image; "
        "parquet: with --engine ray",
    )
    _add_caption_on_ray(p)
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA where present (%(default)s)",
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=16, help="images per beam search (%(default)s)"
    )
    p.add_argument("--beam-size", type=_positive_int, default=None, help="default: eval.beam_size")
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=2,
        help="threads decoding the next batch (%(default)s)",
    )
    p.add_argument(
        "--attention-out",
        default=None,
        metavar="DIR",
        help="write one attention figure per image here (the photo, then a map per word) "
        "and index.html listing them",
    )
    p.set_defaults(handler=_caption, quiet=True)


# ----------------------------------------------------------------------------- profile
def _profile_new(args: argparse.Namespace) -> int:
    from pipeline.stages.profiles import ProfileError, new_profile

    root = Path.cwd().resolve()
    try:
        folder = new_profile(root, args.name, Path(args.images), Path(args.captions))
    except ProfileError as e:
        raise CommandError(str(e)) from None
    rel = folder.relative_to(root.resolve()) if folder.is_relative_to(root.resolve()) else folder
    print(f"wrote {rel}/params.yaml and {rel}/dvc.yaml; next:")
    print(f"  make run PROFILE={args.name}")
    print(f"  .venv/bin/sat caption --params {rel}/params.yaml path/to/photo.jpg")
    print(f"  .venv/bin/sat serve --params {rel}/params.yaml")
    return 0


def _one_line_usage_errors(parser: argparse.ArgumentParser, command: str) -> None:
    """argparse's own errors as every other error of the command: one line, status 1."""

    def error(message: str) -> NoReturn:
        print(f"sat {command}: error: {message}", file=sys.stderr)
        raise SystemExit(1)

    parser.error = error  # type: ignore[method-assign]


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="dataset profiles (profiles/<name>/)")
    _one_line_usage_errors(p, "profile")
    actions = p.add_subparsers(dest="action", required=True)
    new = actions.add_parser(
        "new", help="a profile for your own photos and a captions file (README, Your own data)"
    )
    _one_line_usage_errors(new, "profile")
    new.add_argument("name", help="the profile's folder name under profiles/")
    new.add_argument("--images", required=True, metavar="DIR", help="the folder of photos")
    new.add_argument(
        "--captions",
        required=True,
        metavar="FILE",
        help="CSV or JSON lines: file (relative to --images), caption, optional split",
    )
    new.set_defaults(handler=_profile_new, command="profile")


def _is_user_error(err: BaseException) -> bool:
    return isinstance(err, CommandError) or is_user_error(err)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    if not args.verbose and getattr(args, "quiet", False):
        quiet_mlflow()
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"sat {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose or not _is_user_error(e):
            raise
        print(f"sat {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
