"""Epoch time of the train stage on this machine's device: one likelihood epoch, one
self-critical epoch and one validation decode, through the trainer's own code.

The captions are the prepared ones (``captions.parquet`` and ``vocab.json`` of the profile's
``data.prepared_dir``), batched by the stage's sampler; the model, criterion, optimiser,
``train.mixed_precision`` and the self-critical reward are the stage's. Only the features are
made up: random values of the store's shape (``--grid``, or the shape recorded in
``encoder.features_dir``'s ``train.arrow`` where it exists), held in memory, because an epoch's
time does not depend on the values and the photos may not be on the machine that measures (a GPU
machine reached from outside). The validation decode runs every caption to ``val_max_length``
words (the longest it can take; real captions end earlier). Left out of an epoch of the stage:
reading the memory-mapped store (~1 % of an epoch on 2 cores), writing the model folder, and
scoring the validation captions (pycocoevalcap's Java tokenizer; ``bench_eval.py`` times it).

    .venv/bin/python benchmarks/bench_epoch.py [--params profiles/flickr8k/params.yaml]
        [--device cuda] [--mixed-precision bf16] [--attention soft hard] [--grid 9x9x1280]

Writes JSON to stdout and ``benchmarks/results/epoch_<profile>_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline.settings import Params, load_params
from sat_model.config import ATTENTION_KINDS, HardTrainConfig, SoftTrainConfig
from sat_model.data.tables import read_caption_rows
from sat_model.data.vocab import END_ID, Vocab, load_vocab
from sat_model.features.store import FeatureStore
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.decoding import greedy
from sat_model.model.factory import build_model
from sat_model.model.losses import SelfCriticalLoss, build_criterion
from sat_model.train.batching import CaptionDataset, LengthGroupedBatchSampler
from sat_model.train.optim import build_optimizer
from sat_model.train.run import semi_sampling_options
from sat_model.train.self_critical import (
    ImageBatches,
    Reward,
    SamplingPlan,
    references_by_image,
    self_critical_step,
)
from sat_model.train.trainer import FitOptions, Objective, fit

__all__ = ["RandomFeatures", "bench_epoch", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
PROJECT = Path(__file__).resolve().parents[1]


class RandomFeatures:
    """A feature source of ``(H*W, D)`` float16 rows of standard normal values, one per image id
    (the store's layout: ``sat_model.train.batching.FeatureSource``)."""

    def __init__(self, ids: Sequence[str], grid: tuple[int, int, int], seed: int = 0) -> None:
        h, w, d = grid
        self._ids = list(ids)
        rng = np.random.default_rng(seed)
        self.rows = rng.standard_normal((len(self._ids), h * w, d), dtype=np.float32).astype(
            np.float16
        )  # (N, L, D)

    @property
    def ids(self) -> Sequence[str]:
        return self._ids

    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        return self.rows[np.asarray(indices, dtype=np.int64)]  # (B, L, D)


def _split(
    params: Params, prepared: Path, split: str, grid: tuple[int, int, int]
) -> tuple[CaptionDataset, Vocab]:
    """The split's caption dataset over random features of ``grid``, and the vocabulary."""
    vocab = load_vocab(prepared / "vocab.json")
    rows = read_caption_rows(prepared / "captions.parquet", split, ["image_id", "tokens"])
    ids = sorted(set(rows["image_id"]))
    row_of = {image_id: i for i, image_id in enumerate(ids)}
    store = RandomFeatures(ids, grid, seed=params.train.seed)
    dataset = CaptionDataset(
        store,
        [row_of[i] for i in rows["image_id"]],
        [vocab.encode_caption(t) for t in rows["tokens"]],
        vocab.pad_id,
    )
    return dataset, vocab


def _seconds(device: torch.device, fn: Callable[[], object]) -> float:
    """Wall time of ``fn``, from an idle device to the end of its last kernel."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_epoch(
    params: Params,
    prepared: Path,
    grid: tuple[int, int, int],
    attention: str,
    device: torch.device,
    max_batches: int | None = None,
) -> dict:
    """Seconds of one likelihood epoch, one self-critical epoch (where the profile has them) and
    one validation decode, as the train stage runs them; with ``max_batches``, the first batches
    of each epoch, scaled to the whole epoch by the batch count."""
    cfg = params.train.soft if attention == "soft" else params.train.hard
    dataset, vocab = _split(params, prepared, "train", grid)
    model = _model(params, cfg, len(vocab), grid, attention, device)
    sampler = LengthGroupedBatchSampler(dataset.lengths, cfg.batch_size, seed=params.train.seed)
    options = _fit_options(params, cfg, device)
    out = {
        "attention": attention,
        "mixed_precision": params.train.mixed_precision,
        "train_captions": len(dataset),
    }
    out |= _likelihood_epoch(
        model, dataset, sampler.batches(0), cfg, attention, options, max_batches
    )
    if cfg.scst_epochs > 0:
        out |= _self_critical_epoch(model, dataset, params, cfg, options, max_batches)
    return out | _validation_decode(model, params, prepared, grid, attention, device)


def _model(
    params: Params,
    cfg: SoftTrainConfig | HardTrainConfig,
    vocab_size: int,
    grid: tuple[int, int, int],
    attention: str,
    device: torch.device,
) -> ShowAttendTell:
    """The stage's model for ``attention`` at the features' shape, seeded as the stage seeds it."""
    h, w, d = grid
    torch.manual_seed(params.train.seed)
    return build_model(
        params.model,
        vocab_size=vocab_size,
        annotation_dim=d,
        num_locations=h * w,
        grid_w=w,
        attention=attention,
        **semi_sampling_options(cfg),
    ).to(device)


def _fit_options(
    params: Params, cfg: SoftTrainConfig | HardTrainConfig, device: torch.device
) -> FitOptions:
    """The stage's options for one epoch: clipping, EMA and ``train.mixed_precision``."""
    return FitOptions(
        max_epochs=1,
        patience=1,
        device=device,
        grad_clip=cfg.grad_clip,
        seed=params.train.seed * 1_000,
        ema_decay=cfg.ema_decay,
        autocast_dtype=torch.bfloat16 if params.train.mixed_precision == "bf16" else None,
    )


def _likelihood_epoch(
    model: ShowAttendTell,
    dataset: CaptionDataset,
    batches: list[list[int]],
    cfg: SoftTrainConfig | HardTrainConfig,
    attention: str,
    options: FitOptions,
    max_batches: int | None,
) -> dict:
    """One likelihood epoch over the sampler's ``batches`` (the first ``max_batches`` timed)."""
    timed = batches[:max_batches]
    likelihood = fit(
        model,
        Objective(
            build_criterion(attention, cfg),
            build_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay),
        ),
        lambda epoch: (dataset.collate(b) for b in timed),
        None,
        options,
    ).history[0]
    return {
        "likelihood_epoch_s": likelihood.train_seconds * len(batches) / len(timed),
        "likelihood_batches": len(batches),
        "likelihood_batches_timed": len(timed),
        "likelihood_captions_per_s": likelihood.captions / likelihood.train_seconds,
    }


def _self_critical_epoch(
    model: ShowAttendTell,
    dataset: CaptionDataset,
    params: Params,
    cfg: SoftTrainConfig | HardTrainConfig,
    options: FitOptions,
    max_batches: int | None,
) -> dict:
    """One self-critical epoch: ``scst_batch_size`` training images a batch, captions sampled
    from the model and rewarded as the stage rewards them (the first ``max_batches`` timed)."""
    reward = Reward(references_by_image(dataset), cfg.scst_bleu_weight, cfg.scst_bleu1_weight)
    plan = SamplingPlan(
        cfg.scst_batch_size, cfg.scst_samples, params.train.val_max_length, params.train.seed
    )
    images = ImageBatches(dataset, model, reward, plan, epoch=0)
    total = len(images.batches)
    images.batches = images.batches[:max_batches]
    scst = fit(
        model,
        Objective(
            SelfCriticalLoss(),
            build_optimizer(model.parameters(), cfg.optimizer, cfg.scst_lr),
            step_loss=self_critical_step,
        ),
        lambda epoch: images,
        None,
        options,
    ).history[0]
    return {
        "self_critical_epoch_s": scst.train_seconds * total / len(images.batches),
        "self_critical_batches": total,
        "self_critical_batches_timed": len(images.batches),
    }


def _validation_decode(
    model: ShowAttendTell,
    params: Params,
    prepared: Path,
    grid: tuple[int, int, int],
    attention: str,
    device: torch.device,
) -> dict:
    """Seconds of the stage's greedy decode of the validation images, every caption run to
    ``val_max_length`` words."""
    val, _ = _split(params, prepared, "val", grid)
    val_rows = sorted(set(val.image_indices.tolist()))
    if params.train.val_images:
        val_rows = val_rows[: params.train.val_images]
    mode = params.eval.hard_decode if attention == "hard" else "expected"
    model.eval()
    with torch.no_grad():  # every caption runs to val_max_length: the decode's longest time
        model.out.bias[END_ID] = -1e4

    def decode() -> None:
        for start in range(0, len(val_rows), params.eval.batch_size):
            chunk = val_rows[start : start + params.eval.batch_size]
            feats = torch.from_numpy(val.store.get_batch(chunk)).to(device, torch.float32)
            greedy(model, feats, params.train.val_max_length, mode=mode)

    with torch.no_grad():
        seconds = _seconds(device, decode)
    return {"validation_images": len(val_rows), "validation_decode_s": seconds}


def _grid(text: str | None, params: Params, root: Path) -> tuple[int, int, int]:
    if text:
        h, w, d = (int(x) for x in text.lower().split("x"))
        return h, w, d
    store = root / params.encoder.features_dir / "train.arrow"
    if not store.exists():
        raise SystemExit(f"no {store} to read the feature shape from: give --grid HxWxD")
    spec = FeatureStore(store).spec
    return spec.grid_h, spec.grid_w, spec.D


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml", help="the profile's params file")
    parser.add_argument("--prepared", default=None, help="default: the profile's prepared_dir")
    parser.add_argument("--grid", default=None, help="HxWxD of the features, e.g. 14x14x112")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mixed-precision", nargs="+", default=["none"], choices=["none", "bf16"])
    parser.add_argument("--attention", nargs="+", default=list(ATTENTION_KINDS))
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="time the first N batches of each epoch and scale to the epoch (default: all)",
    )
    args = parser.parse_args(argv)
    params_path = Path(args.params).resolve()
    root = params_path.parent  # paths in a params file are relative to its folder
    params = load_params(params_path)
    prepared = Path(args.prepared) if args.prepared else root / params.data.prepared_dir
    if not (prepared / "captions.parquet").exists():
        raise SystemExit(f"no {prepared / 'captions.parquet'}: run the prepare stage (make run)")
    grid = _grid(args.grid, params, root)
    device = torch.device(args.device)
    rows = []
    for precision in args.mixed_precision:
        p = params.model_copy(
            update={"train": params.train.model_copy(update={"mixed_precision": precision})}
        )
        for attention in args.attention:
            rows.append(bench_epoch(p, prepared, grid, attention, device, args.max_batches))
    result = {
        "params": str(args.params),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "grid": list(grid),
        "epochs": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    profile = "default" if root == PROJECT else root.name
    name = f"epoch_{profile}_{device.type}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
