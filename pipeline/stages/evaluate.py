"""DVC stage ``evaluate@<attention>``: a model on the test split -> ``reports/<attention>/``.

Writes ``metrics.json`` (flat keys ``bleu_1``..``bleu_4``, ``meteor``, ``rouge_l``, ``cider``,
``pointing_accuracy`` where the source has boxes: scores only), ``captions.json`` (the captions
and the counts) and ``attention/`` (one figure per image, ``images/000.png``..., and
``index.html``). ``--model`` evaluates any model folder or MLflow model URI
(``models:/sat-captioner@champion``, resolved in the tracking store of ``mlflow.tracking_uri``)
instead, as ``sat evaluate`` does; its reports go to ``--out``, by default
``reports/eval/<model name>``, never into the DVC output of an ``evaluate@<attention>`` stage.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pipeline.stages import StageContext, cli_context, finished, run_locked, stage_parser
from pipeline.stages.user_errors import user_errors_in_one_line
from pipeline.tracking.model_uri import is_model_uri, resolve_model_dir
from sat_model.config import ATTENTION_KINDS
from sat_model.evaluation.metrics import headline_keys, metric_label
from sat_model.evaluation.reports import GALLERY_DIR, NAMED_MODELS_DIR

if TYPE_CHECKING:
    from sat_model.data.tables import ImageRecord
    from sat_model.evaluation.evaluate import EvaluationResult

__all__ = ["add_arguments", "default_out_dir", "main", "run", "summary"]

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The stage's own flags, shared by ``python -m pipeline.stages.evaluate`` and
    ``sat evaluate``."""
    parser.add_argument("--model", default=None, help="model folder or models:/ URI")
    parser.add_argument(
        "--attention",
        choices=ATTENTION_KINDS,
        default="soft",
        help="without --model: evaluate models/<attention> into reports/<attention>, "
        "as the DVC stage does (%(default)s)",
    )
    parser.add_argument("--split", default=None, help="split to evaluate (default: eval.split)")
    parser.add_argument(
        "--out",
        default=None,
        help="report folder (default: reports/<attention>, or reports/eval/<model> with --model)",
    )


def default_out_dir(reports_dir: str | Path, attention: str, model: str | None) -> Path:
    """``reports/<attention>`` for the stage's own model; ``reports/eval/<model name>`` for any
    model named with ``--model`` (``models/hard`` -> ``hard``, ``models:/m@champion`` ->
    ``m@champion``), so that it never overwrites another stage's DVC output."""
    if model is None:
        return Path(reports_dir) / attention
    name = model.split(":/", 1)[-1] if is_model_uri(model) else Path(model).resolve().name
    return (
        Path(reports_dir)
        / NAMED_MODELS_DIR
        / (re.sub(r"[^\w@.+-]+", "-", name).strip("-.") or "model")
    )


def _is_gallery(folder: Path) -> bool:
    """A gallery this stage wrote: ``index.html`` and figure PNGs (in ``images/``), nothing
    else."""
    from sat_model.evaluation.visualize import FIGURES_DIR, INDEX_FILE

    def ours(path: Path) -> bool:
        if path.is_dir() and path.name == FIGURES_DIR:
            return all(p.is_file() and p.suffix == ".png" for p in path.iterdir())
        return path.is_file() and (path.name == INDEX_FILE or path.suffix == ".png")

    return all(ours(p) for p in folder.iterdir())


def _write_gallery(out_dir: Path, write: Callable[[Path], T]) -> T:
    """``write(folder)`` into a temporary folder, then swap it for ``out_dir/attention`` whole
    (stale PNGs never linger; temporary folders of killed runs are removed first)."""
    from sat_model.atomic import remove_dead_temps, replace_dir, temp_dir

    remove_dead_temps(out_dir, GALLERY_DIR)
    staging = temp_dir(out_dir, GALLERY_DIR)
    try:
        written = write(staging)
        replace_dir(staging, out_dir / GALLERY_DIR, owned=_is_gallery)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser(__name__, __doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    ctx = cli_context("evaluate", args)
    # a model or data the user named that cannot be evaluated: one line
    return user_errors_in_one_line(
        "evaluate",
        lambda: run(ctx, args.attention, model=args.model, split=args.split, out=args.out),
    )


def run(
    ctx: StageContext,
    attention: str = "soft",
    *,
    model: str | None = None,
    split: str | None = None,
    out: str | None = None,
) -> int:
    """Evaluate ``model`` (default ``<models_dir>/<attention>``) on ``split`` into ``out``."""
    from sat_model.paths import output_path

    def out_dir() -> Path:  # a PathError here is reported by run_locked in one line
        if out is not None:
            return Path(out).resolve()  # named by the user on the command line
        reports = default_out_dir(ctx.params.eval.reports_dir, attention, model)
        return output_path(str(reports), ctx.root)

    name = model or str(ctx.path(ctx.params.train.models_dir) / attention)
    stage = "evaluate" if model else f"evaluate@{attention}"  # the DVC stage's name
    return run_locked(
        "evaluate",
        out_dir,
        lambda: _evaluate(
            ctx, name, attention, split or ctx.params.eval.split, out_dir(), stage=stage
        ),
    )


def _evaluate(
    ctx: StageContext, model: str, attention: str, split: str, out_dir: Path, *, stage: str
) -> int:
    import torch

    from sat_model.data.sources import image_root
    from sat_model.data.tables import CAPTIONS_FILE, IMAGES_FILE
    from sat_model.evaluation.evaluate import (
        DataSplit,
        evaluate_model,
        read_image_records,
        write_reports,
    )
    from sat_model.features.store import store_file

    params, ev, started = ctx.params, ctx.params.eval, time.perf_counter()
    prepared = ctx.path(params.data.prepared_dir)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = resolve_model_dir(model, workdir, _tracking_uri(ctx, model))
        data = DataSplit(
            split,
            ctx.path(params.encoder.features_dir) / store_file(split),
            prepared / CAPTIONS_FILE,
            prepared / IMAGES_FILE,
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        result = evaluate_model(model_dir, data, ev, params.encoder, device=device)
        records = read_image_records(
            prepared / IMAGES_FILE, split, image_root(params.data, ctx.root)
        )
        gallery = _gallery(ctx, model_dir, attention, split, result, records)
        _, gallery_skipped = _write_gallery(out_dir, gallery)
    result.skipped.extend({**s, "stage": "gallery"} for s in gallery_skipped)
    write_reports(result, out_dir, split)
    finished(
        stage, summary(result.metrics, split, len(result.captions)), out_dir, ctx.root, started
    )
    return 0


def summary(metrics: Mapping[str, float], split: str, images: int) -> str:
    """``test BLEU-4 0.9068, METEOR 0.4321, CIDEr 2.3456, pointing 0.8612 on 500 images``."""
    names = [(metric_label(k), k) for k in headline_keys()]
    names.append(("pointing", "pointing_accuracy"))  # generated scenes: grounding is scored
    scores = ", ".join(f"{name} {metrics[key]:.4f}" for name, key in names if key in metrics)
    return f"{split} {scores} on {images} images"


def _gallery(
    ctx: StageContext,
    model_dir: Path,
    attention: str,
    split: str,
    result: EvaluationResult,
    records: Mapping[str, ImageRecord],
) -> Callable[[Path], tuple[Path, list[dict[str, str]]]]:
    """``write(folder)``: the attention figures of the first ``eval.gallery_images`` captions,
    decoded as :func:`sat_model.evaluation.evaluate.evaluate_model` decodes them, with each
    image's references and scores."""
    from sat_model.evaluation.evaluate import FeatureView, write_attention_gallery
    from sat_model.model.decoding import decode_mode

    grid_h, grid_w, crop, attention = _grid(model_dir, attention)
    encoder = ctx.params.encoder
    return functools.partial(
        write_attention_gallery,
        result.captions,
        records,
        count=ctx.params.eval.gallery_images,
        view=FeatureView(grid_h, grid_w, encoder.resize, crop, encoder.keep_aspect),
        title=f"{attention} attention, {split} split",
        mode=decode_mode(ctx.params.eval.hard_decode, attention),
        scored=result,
    )


def _tracking_uri(ctx: StageContext, model: str) -> str | None:
    """The project's tracking store for an MLflow model URI (``mlflow.tracking_uri`` honoured)."""
    if not is_model_uri(model):
        return None
    from pipeline.tracking.store import resolve_tracking_uri

    return resolve_tracking_uri(ctx.params.mlflow, ctx.root)


def _grid(model_dir: Path, attention: str) -> tuple[int, int, int, str]:
    """``(grid_h, grid_w, crop, attention)`` recorded in the model's ``config.json``."""
    from sat_model.features.spec import EncoderSpec
    from sat_model.model.checkpoint import CONFIG_FILE

    config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    spec = EncoderSpec.from_config(config, model_dir)
    return spec.grid_h, spec.grid_w, spec.input_size, str(config.get("attention", attention))


if __name__ == "__main__":
    raise SystemExit(main())
