"""DVC stage ``extract``: prepared images → ``data/features/{split}.arrow`` and a report
(with ``encoder.mirror_train``, also ``train_mirrored.arrow``: the train photos mirrored).

The report beside the stores says what was extracted and is the same on every run that writes
the same stores, so the features' hash, and the trainings after them, stay as they were after a
re-run. The run's engine and speed are printed and kept in
``{eval.reports_dir}/extract_timing.json``, a local record that is not a DVC output: DVC would
store an uncached output in its run cache all the same, and a clone that pulls the outputs
would lack it.

    python -m pipeline.stages.extract [--params params.yaml] [-S encoder.engine=ray ...]

``encoder.engine: local`` runs ``sat_model.features.extract`` in this process (DataLoader decoding
workers); ``ray`` runs the same batches on Ray Data actors (``pipeline.ray.extract``) and writes
a byte-identical store.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.settings import Params
from pipeline.stages import StageContext, cli_context, finished, stage_parser
from pipeline.stages.user_errors import user_errors_in_one_line
from sat_model.atomic import write_text_atomic
from sat_model.data.sources import image_root
from sat_model.data.tables import IMAGES_FILE
from sat_model.evaluation.reports import EXTRACT_TIMING_FILE
from sat_model.features.encoders import build_encoder
from sat_model.features.extract import ExtractReport, extract_features
from sat_model.features.store import REPORT_FILE
from sat_model.paths import absolute

__all__ = ["main", "run", "run_extract", "summary", "write_report", "write_timing"]


def _ray_runner(params: Params, weights: str | None, num_cpus_hint: int):
    import ray

    from pipeline.ray.extract import RaySplitRunner

    cfg = params.encoder
    gpus = int(ray.cluster_resources().get("GPU", 0))
    # "auto" asks the cluster, not this driver: a laptop driver may reach a GPU cluster
    use_gpu = gpus > 0 if params.ray.use_gpu == "auto" else params.ray.use_gpu == "true"
    if use_gpu and not gpus:
        raise ValueError("ray.use_gpu is 'true' but the Ray cluster has no GPU")
    cpus = int(ray.cluster_resources().get("CPU", num_cpus_hint))
    actors = gpus if use_gpu else max(1, cpus // cfg.torch_threads)
    return RaySplitRunner(weights, actors, use_gpu, cfg.torch_threads)


def run_extract(params: Params, root: Path, progress: bool = True) -> ExtractReport:
    """Build the encoder from ``params.encoder`` and extract every split (either engine)."""
    cfg = params.encoder
    torch.set_num_threads(cfg.torch_threads)  # decoding workers take the other cores
    weights = str(absolute(cfg.weights, root)) if cfg.weights else None
    encoder = build_encoder(cfg.name, cfg.layer, weights, input_size=cfg.crop)
    extract = functools.partial(
        extract_features,
        absolute(params.data.prepared_dir, root) / IMAGES_FILE,
        image_root(params.data, root),  # from params, never from the table
        absolute(cfg.features_dir, root),
        encoder,
        cfg,
        progress=progress,
    )
    if cfg.engine == "local":
        return extract()
    from pipeline.ray.runtime import ray_session

    with ray_session(params.ray):
        return extract(run_split=_ray_runner(params, weights, params.ray.num_cpus))


def write_report(report: ExtractReport, out_dir: Path) -> Path:
    """Write ``extract_report.json`` atomically and durably (temp file, fsync, rename)."""
    path = out_dir / REPORT_FILE
    write_text_atomic(path, json.dumps(report.to_dict(), indent=2) + "\n")
    return path


def write_timing(report: ExtractReport, reports_dir: Path) -> Path:
    """Write ``extract_timing.json`` (engine, seconds, photos a second) atomically."""
    path = reports_dir / EXTRACT_TIMING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report.timing(), indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = stage_parser(__name__, __doc__).parse_args(argv)
    ctx = cli_context("extract", args)
    # photos, weights or a table the user's params name: one line
    return user_errors_in_one_line("extract", lambda: run(ctx))


def run(ctx: StageContext) -> int:
    """Extract every split, write the report beside the stores and the timing apart."""
    started = time.perf_counter()
    report = run_extract(ctx.params, ctx.root)
    features = ctx.path(ctx.params.encoder.features_dir)
    write_report(report, features)
    write_timing(report, ctx.path(ctx.params.eval.reports_dir))
    finished("extract", summary(report), features, ctx.root, started)
    return 0


def summary(report: ExtractReport) -> str:
    """``5750 images by efficientnet_lite0 blocks.4 (14x14x112 each; local, 85 images/s)``,
    with the skipped ones when there are any."""
    enc = report.encoder
    rate = report.extracted / report.seconds if report.seconds > 0 else 0.0
    text = (
        f"{report.extracted} images by {enc.name} {enc.layer} ({enc.grid_h}x{enc.grid_w}x"
        f"{enc.annotation_dim} each; {report.engine}, {rate:.0f} images/s)"
    )
    if any(s.skipped for s in report.splits):
        text += f"; {report.skipped_summary()}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
