"""``sat caption``: caption image files and folders with the champion (or a model folder), in
one process or on Ray Data (``--engine ray``); attention figures on request."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from pipeline.cli.commands import CommandError, add_command
from pipeline.cli.project import model_name, params_or_defaults, tracking_uri, use_mlflow
from pipeline.stages import add_params_args
from sat_model.features.image_files import find_image_files

__all__ = ["NO_CHAMPION", "add_parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


NO_CHAMPION = (
    "no champion model registered as {uri} (tracking store {store}): run `make run`, "
    "or pass --model models/soft"
)


def _caption_model_dir(args: argparse.Namespace, workdir: Path) -> Path:
    """The model folder to caption with: ``--model`` as a folder, or a downloaded MLflow model
    (by default the champion); a missing model is a :class:`CommandError`."""
    from pipeline.tracking.model_uri import is_model_uri, resolve_model_dir

    model = args.model or f"models:/{model_name(args)}@champion"
    if not is_model_uri(model):
        from sat_model.model.checkpoint import MODEL_FILE, is_checkpoint_dir

        if not is_checkpoint_dir(model):
            raise CommandError(f"{model} is not a model folder (no {MODEL_FILE} in it)")
        return Path(model)
    from pipeline.tracking.store import redact

    uri = tracking_uri(args)
    missing = CommandError(NO_CHAMPION.format(uri=model, store=redact(uri)))
    # an absent SQLite store holds no model: say so before MLflow creates an empty one here
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise missing
    use_mlflow(args)
    from mlflow.exceptions import MlflowException

    try:
        return resolve_model_dir(model, workdir, uri)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise missing from e
        raise


def _say_what_it_knows(data_source: str | None) -> None:
    """The scenes notice (:mod:`pipeline.cli.notices`) on stderr: stdout stays the captions."""
    from pipeline.cli.notices import scenes_notice

    notice = scenes_notice(data_source)
    if notice:
        print(f"sat caption: note: {notice}", file=sys.stderr)


def _caption_device(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda: no CUDA device is available here")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _print_caption(found, fmt: str, figures) -> None:
    from tqdm import tqdm

    from sat_model.features.drift import drift_fields

    result = found.caption
    drift = result.drift if result is not None else None
    if fmt == "jsonl":
        row = {"path": found.path, "caption": result.text if result else None, "error": found.error}
        tqdm.write(json.dumps(row | drift_fields(drift)), file=sys.stdout)
    elif result is None:
        tqdm.write(f"{found.path}: error: {found.error}", file=sys.stderr)
    else:
        mark = ""
        if drift is not None and drift.drifted:
            mark = f"  [drift {drift.score:.1f}: far from the training photos]"
        tqdm.write(f"{found.path}: {result.text}{mark}", file=sys.stdout)
    if result is not None and figures is not None:  # --attention-out
        from sat_model.evaluation.visualize import Attended

        attended = Attended(
            result.words, result.alphas, result.grid_h, result.grid_w, result.locations
        )
        figures.add(found.path, Path(found.path).stem, result.crop, attended)


def _attention_figures(folder: str | None, mode: str) -> Any:
    """``--attention-out``: a figure per image and ``index.html`` (written when captioning ends)."""
    if not folder:
        return None
    from sat_model.evaluation.visualize import AttentionFigures

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
    from pipeline.cli.notices import model_source
    from pipeline.ray.caption import caption_with_ray_data, check_destination
    from pipeline.ray.runtime import ray_session

    check_destination(out)  # before any model loads: an earlier run's files only, or nothing
    params = params_or_defaults(args)
    options = _captioner_options(params.eval, args.batch_size)
    if args.beam_size:
        options["beam_size"] = args.beam_size
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _caption_model_dir(args, Path(tmp))  # checked before Ray starts
        with ray_session(params.ray, address=args.address):
            _say_what_it_knows(model_source(model_dir))
            result = caption_with_ray_data(
                source,
                out,
                model_dir,
                options,
                max_pixels=params.encoder.max_image_pixels,
                fmt="parquet" if args.format == "parquet" else "jsonl",
                actors=args.actors,
            )
    from sat_model.features.drift import drift_note

    done = result.rows - result.errors
    far = "" if result.drifted is None else f"; {drift_note(result.drifted, done)}"
    print(f"captioned {done} of {result.rows} images into {result.out}{far}")
    if result.errors:
        print(f"{result.errors} could not be captioned: their rows say why", file=sys.stderr)
    return 0 if result.rows > result.errors else 1


def _caption(args: argparse.Namespace) -> int:
    """Caption image files and folders in batches; a bad image gets its own error, the others
    still run; exit 1 when no image could be captioned."""
    if args.engine == "ray":
        return _caption_on_ray(args)
    if args.out:
        raise CommandError("--out is for --engine ray; here captions go to stdout")
    missing = [i for i in args.inputs if not Path(i).exists()]
    if len(missing) == len(args.inputs):  # the first cause, before any model is looked up
        raise CommandError(f"no such file or folder: {' '.join(missing)}")
    paths = find_image_files(args.inputs)
    if not paths:
        raise CommandError(f"no image files in {' '.join(args.inputs)}")
    params = params_or_defaults(args)
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _caption_model_dir(args, Path(tmp))  # checked before PyTorch loads
        from sat_model.captioner import Captioner

        captioner = Captioner.from_dir(
            model_dir,
            device=_caption_device(args.device),
            **_captioner_options(params.eval, args.batch_size),
        )
    _say_what_it_knows(captioner.data_source)
    # a bar only where someone watches (a terminal) and only when there is more than one batch
    bar = tqdm(
        total=len(paths),
        unit="image",
        file=sys.stderr,
        leave=False,
        disable=None if len(paths) > args.batch_size else True,
    )
    figures = _attention_figures(args.attention_out, captioner.mode)
    ok = drifted = 0
    with bar, nullcontext() if figures is None else figures:
        for found in captioner.caption_files(
            paths,
            beam_size=args.beam_size,
            max_pixels=params.encoder.max_image_pixels,
            workers=args.workers,
        ):
            _print_caption(found, args.format, figures)
            ok += found.caption is not None
            drifted += bool(found.caption and found.caption.drift and found.caption.drift.drifted)
            bar.update()
    if drifted:
        from sat_model.features.drift import drift_note

        print(f"sat caption: {drift_note(drifted, ok)}", file=sys.stderr)
    return 0 if ok else 1


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


def _add_caption_decoding(p: argparse.ArgumentParser) -> None:
    """``sat caption``'s device, batch, beam and decoding-thread options."""
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "caption",
        summary="caption image files and folders; attention figures",
        description="One caption per image, by the champion (models:/<mlflow.model_name>"
        "@champion) or the model named with --model; folders are searched recursively. A bad "
        "image gets its own error line and the others are still captioned; the status is 1 "
        "when none could be. The default pipeline's champion knows the generated scenes of "
        "shapes, not photos: for photos, make run PROFILE=flickr8k.",
        examples=[
            "sat caption data/prepared/images/test_00000.png  # a scene `make run` generated",
            "sat caption photos/ --format jsonl --params profiles/flickr8k/params.yaml",
            "sat caption data/prepared/images/test_00001.png --attention-out attention/",
        ],
    )
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
        help="text: 'path: caption' lines; jsonl: one {path, caption, error, drift, drifted} "
        "per image; parquet: with --engine ray",
    )
    _add_caption_on_ray(p)
    _add_caption_decoding(p)
    p.add_argument(
        "--attention-out",
        default=None,
        metavar="DIR",
        help="write one attention figure per image here (the photo, then a map per word) "
        "and index.html listing them",
    )
    p.set_defaults(handler=_caption)
