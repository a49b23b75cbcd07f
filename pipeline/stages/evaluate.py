"""DVC stage ``evaluate@<attention>``: a model on the test split -> ``reports/<attention>/``.

Writes ``metrics.json`` (flat keys ``bleu_1``..``bleu_4``, ``meteor``, ``rouge_l``, ``cider``,
``pointing_accuracy`` where the source has boxes), ``captions.json`` and ``attention/`` (per-word
overlay PNGs and ``index.html``). ``--model`` evaluates any model folder or MLflow model URI
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
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pipeline.stages import run_locked, stage_parser

if TYPE_CHECKING:
    from sat_model.config import Params

__all__ = ["default_out_dir", "is_model_uri", "main", "resolve_model_dir"]

T = TypeVar("T")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--attention", choices=("soft", "hard"), default="soft")
    parser.add_argument("--model", default=None, help="model folder or models:/ URI")
    parser.add_argument("--split", default=None, help="split to evaluate (default: eval.split)")
    parser.add_argument(
        "--out",
        default=None,
        help="report folder (default: reports/<attention>, or reports/eval/<model> with --model)",
    )
    return parser.parse_args(argv)


def is_model_uri(model: str) -> bool:
    """Whether ``model`` names an MLflow model (``models:/``, ``runs:/``, ``s3://`` ...)."""
    return "://" in model or model.startswith(("models:/", "runs:/"))


def default_out_dir(reports_dir: str | Path, attention: str, model: str | None) -> Path:
    """``reports/<attention>`` for the stage's own model; ``reports/eval/<model name>`` for any
    model named with ``--model`` (``models/hard`` -> ``hard``, ``models:/m@champion`` ->
    ``m@champion``), so that it never overwrites another stage's DVC output."""
    if model is None:
        return Path(reports_dir) / attention
    name = model.split(":/", 1)[-1] if is_model_uri(model) else Path(model).resolve().name
    return Path(reports_dir) / "eval" / (re.sub(r"[^\w@.+-]+", "-", name).strip("-.") or "model")


def resolve_model_dir(model: str, workdir: Path, tracking_uri: str | None = None) -> Path:
    """A local model folder as is; an MLflow URI (``models:/``, ``runs:/``) downloaded into
    ``workdir`` and its checkpoint artifact returned."""
    if not is_model_uri(model):
        return Path(model)
    import mlflow

    from pipeline.pyfunc_model import CHECKPOINT_ARTIFACT

    if model.startswith("models:/") and tracking_uri:
        model = _registry_location(model, tracking_uri)
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
    """A gallery this stage wrote: ``index.html`` and overlay PNGs (in ``images/``), nothing
    else."""
    from sat_model.evaluate import GALLERY_IMAGES_DIR

    def ours(path: Path) -> bool:
        if path.is_dir() and path.name == GALLERY_IMAGES_DIR:
            return all(p.is_file() and p.suffix == ".png" for p in path.iterdir())
        return path.is_file() and (path.name == "index.html" or path.suffix == ".png")

    return all(ours(p) for p in folder.iterdir())


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


def _registry_location(model: str, tracking_uri: str) -> str:
    """Where the registered model version ``models:/NAME@ALIAS[/path]`` (or ``NAME/VERSION``)
    stores its files, looked up in the registry at ``tracking_uri``.

    MLflow's own download looks the name up in the process-wide registry URI whatever
    ``tracking_uri`` it is given, so a store named only in params would never be asked.
    """
    from mlflow import MlflowClient
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    base, path = ModelsArtifactRepository.split_models_uri(model)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    found = get_model_name_and_version(client, base)
    if len(found) == 1:  # models:/<logged model id>, not a registry name
        return model
    location = client.get_model_version_download_uri(*found).rstrip("/")
    return f"{location}/{path}" if path else location


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
            else output_path(
                default_out_dir(params.eval.reports_dir, args.attention or "soft", args.model),
                Path.cwd(),
            )
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
    out_dir = (
        Path(args.out) if args.out else default_out_dir(ev.reports_dir, args.attention, args.model)
    )
    prepared = Path(params.data.prepared_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model = args.model or str(Path(params.train.models_dir) / args.attention)
        model_dir = resolve_model_dir(model, workdir, _tracking_uri(params, args.params, model))
        result = evaluate_model(
            model_dir=model_dir, features_path=Path(params.encoder.features_dir) / f"{split}.arrow",
            captions_path=prepared / "captions.parquet", images_path=prepared / "images.parquet",
            split=split, beam_size=ev.beam_size, max_length=ev.max_length,
            resize=params.encoder.resize, length_normalization=ev.length_normalization,
            hard_decode=ev.hard_decode, batch_size=ev.batch_size,
            meteor_timeout_s=ev.meteor_timeout_s, device=device,
        )  # fmt: skip
        grid_h, grid_w, crop, attention = _grid(model_dir, args.attention)
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
            title=f"{attention} attention, {split} split",
        )
        _, gallery_skipped = _write_gallery(out_dir, gallery)
    result.skipped.extend({**s, "stage": "gallery"} for s in gallery_skipped)
    write_reports(result, out_dir, split)
    print(json.dumps(result.metrics, indent=1))
    return 0


def _tracking_uri(params, params_file: str, model: str) -> str | None:
    """The project's tracking store for an MLflow model URI (``mlflow.tracking_uri`` honoured)."""
    if not is_model_uri(model):
        return None
    from pipeline.tracking import resolve_tracking_uri

    return resolve_tracking_uri(params.mlflow, Path(params_file).resolve().parent)


def _grid(model_dir: Path, attention: str) -> tuple[int, int, int, str]:
    """``(grid_h, grid_w, crop, attention)`` recorded in the model's ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    enc = config["encoder"]
    grid = int(enc["grid_h"]), int(enc["grid_w"]), int(enc["input_size"])
    return (*grid, str(config.get("attention", attention)))


if __name__ == "__main__":
    raise SystemExit(main())
