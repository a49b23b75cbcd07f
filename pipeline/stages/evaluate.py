"""DVC stage ``evaluate@<attention>``: a model on the test split -> ``reports/<attention>/``.

Writes ``metrics.json`` (flat keys ``bleu_1``..``bleu_4``, ``meteor``, ``rouge_l``, ``cider``,
``pointing_accuracy`` where the source has boxes), ``captions.json`` and ``attention/`` (per-word
overlay PNGs and ``index.html``). ``--model`` evaluates any model folder or MLflow model URI
(``models:/sat-captioner@champion``) instead, as ``sat evaluate`` does.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pipeline.stages import run_locked, stage_parser

if TYPE_CHECKING:
    from sat_model.config import Params

__all__ = ["main", "resolve_model_dir"]

T = TypeVar("T")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--attention", choices=("soft", "hard"), default="soft")
    parser.add_argument("--model", default=None, help="model folder or models:/ URI")
    parser.add_argument("--split", default=None, help="split to evaluate (default: eval.split)")
    parser.add_argument("--out", default=None, help="report folder (default: reports/<attention>)")
    return parser.parse_args(argv)


def resolve_model_dir(model: str, workdir: Path, tracking_uri: str | None = None) -> Path:
    """A local model folder as is; an MLflow URI (``models:/``, ``runs:/``) downloaded into
    ``workdir`` and its checkpoint artifact returned."""
    if "://" not in model and not model.startswith("models:/") and not model.startswith("runs:/"):
        return Path(model)
    import mlflow

    from pipeline.pyfunc_model import CHECKPOINT_ARTIFACT

    local = mlflow.artifacts.download_artifacts(
        artifact_uri=model, dst_path=str(workdir), tracking_uri=tracking_uri
    )
    found = sorted(Path(local).rglob("model.pt"))
    checkpoints = [p.parent for p in found if p.parent.name == CHECKPOINT_ARTIFACT] or [
        p.parent for p in found
    ]
    if not checkpoints:
        raise FileNotFoundError(f"{model} holds no checkpoint (model.pt)")
    return checkpoints[0]


def _is_gallery(folder: Path) -> bool:
    """A gallery this stage wrote: ``index.html`` and overlay PNGs, nothing else."""
    return all(
        p.is_file() and (p.name == "index.html" or p.suffix == ".png") for p in folder.iterdir()
    )


def _write_gallery(out_dir: Path, write: Callable[[Path], T]) -> T:
    """``write(folder)`` into a temporary folder, then swap it for ``out_dir/attention`` whole
    (stale PNGs never linger; temporary folders of killed runs are removed first)."""
    from sat_model.atomic import remove_dead_temps, replace_dir, temp_dir

    remove_dead_temps(out_dir, "attention")
    staging = temp_dir(out_dir, "attention")
    try:
        written = write(staging)
        replace_dir(staging, out_dir / "attention", owned=_is_gallery)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from sat_model.config import load_params
    from sat_model.paths import output_path

    params = load_params(args.params, args.overrides)
    return run_locked(
        "evaluate",
        lambda: (
            Path(args.out).resolve()  # named by the user on the command line
            if args.out
            else output_path(params.eval.reports_dir, Path.cwd()) / args.attention
        ),
        lambda: _evaluate(args, params),
    )


def _evaluate(args: argparse.Namespace, params: Params) -> int:
    import torch

    from sat_model.evaluate import (
        evaluate_model,
        read_image_records,
        write_attention_gallery,
        write_reports,
    )  # fmt: skip
    from sat_model.paths import image_root

    ev = params.eval
    split = args.split or ev.split
    out_dir = Path(args.out or Path(ev.reports_dir) / args.attention)
    prepared = Path(params.data.prepared_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model = args.model or str(Path(params.train.models_dir) / args.attention)
        model_dir = resolve_model_dir(model, workdir)
        result = evaluate_model(
            model_dir=model_dir, features_path=Path(params.encoder.features_dir) / f"{split}.arrow",
            captions_path=prepared / "captions.parquet", images_path=prepared / "images.parquet",
            split=split, beam_size=ev.beam_size, max_length=ev.max_length,
            resize=params.encoder.resize, length_normalization=ev.length_normalization,
            hard_decode=ev.hard_decode, batch_size=ev.batch_size,
            meteor_timeout_s=ev.meteor_timeout_s, device=device,
        )  # fmt: skip
        grid_h, grid_w, crop = _grid(model_dir)
        records = read_image_records(
            prepared / "images.parquet", split, image_root(params.data, Path.cwd())
        )
        gallery = functools.partial(
            write_attention_gallery,
            result.captions,
            records,
            count=ev.gallery_images,
            grid_h=grid_h,
            grid_w=grid_w,
            resize=params.encoder.resize,
            crop=crop,
            title=f"{args.attention} attention, {split} split",
        )
        _, gallery_skipped = _write_gallery(out_dir, gallery)
    result.skipped.extend({**s, "stage": "gallery"} for s in gallery_skipped)
    write_reports(result, out_dir, split)
    print(json.dumps(result.metrics, indent=1))
    return 0


def _grid(model_dir: Path) -> tuple[int, int, int]:
    """``(grid_h, grid_w, crop)`` recorded in the model's ``config.json`` encoder section."""
    enc = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["encoder"]
    return int(enc["grid_h"]), int(enc["grid_w"]), int(enc["input_size"])


if __name__ == "__main__":
    raise SystemExit(main())
