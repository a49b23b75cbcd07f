"""``sat caption`` throughput: the batched path against one image at a time, on the same photos.

Batched is what ``sat caption`` runs now (:meth:`Captioner.caption_files`: threads decode the next
batch, JPEGs decoded at reduced scale, ``--batch-size`` images per encoder pass and beam search).
One at a time is what it ran before: decode one file, caption it alone, next. Both run in the same
process, interleaved round by round (alternating which goes first) so that a machine whose load
changes during the run slows both alike; the figures are medians over rounds. Model loading and
process start are left out (the same for both).

Data: the Flickr8k sample photos (``../shared/data/flickr8k-sample`` beside the repository, or
``--flickr8k``) when present, else synthetic scenes. The model is untrained (beam search costs the
same whatever the weights) over the default encoder (EfficientNet-Lite0), vocabulary of 1,000.

    .venv/bin/python benchmarks/bench_caption.py [--images 64] [--rounds 3] [--batch-size 16]

JSON to stdout and ``benchmarks/results/caption.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sat_model.paths import shared_data

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLICKR = shared_data("flickr8k-sample")


def _photos(root: Path, n: int, folder: Path) -> tuple[str, list[Path]]:
    if (root / "Flickr8k_Dataset").is_dir():
        return "flickr8k-sample", sorted((root / "Flickr8k_Dataset").glob("*.jpg"))[:n]
    from sat_model.data.scenes import generate_scene, render_scene

    files = []
    for i in range(n):
        scene = generate_scene(seed=0, split="test", index=i, image_size=224)
        files.append(folder / f"{scene.image_id}.png")
        render_scene(scene).save(files[-1])
    return "synthetic", files


def _lite0_model_dir(directory: Path) -> None:
    from sat_model.config import ModelParams
    from sat_model.data.vocab import Vocab
    from sat_model.features.encoders import build_encoder
    from sat_model.model.checkpoint import save_checkpoint
    from sat_model.model.factory import build_model

    d = build_encoder("efficientnet_lite0").spec
    words = ("<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(996)])
    vocab = Vocab(words, 1, 10_000, 20)
    model = build_model(
        ModelParams(),
        vocab_size=len(vocab),
        annotation_dim=d.annotation_dim,
        num_locations=d.num_locations,
        attention="soft",
    )
    save_checkpoint(
        directory,
        model_config=model.config,
        vocab=vocab,
        model_state=model.state_dict(),
        extra_config={"encoder": {**d.to_fields(), "resize": 256}},
    )


def _batched(captioner, files: list[Path], workers: int) -> tuple[float, list[str]]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    found = list(captioner.caption_files(files, workers=workers))
    seconds = time.perf_counter() - start
    assert all(f.caption is not None for f in found), [f.error for f in found if f.error]
    return seconds, [f.caption.text for f in found]


def _one_at_a_time(captioner, files: list[Path]) -> tuple[float, list[str]]:  # type: ignore[no-untyped-def]
    prep = captioner.preprocessing
    start = time.perf_counter()
    texts = [captioner.caption_pixels(prep.pixels(f)[None])[0].text for f in files]
    return time.perf_counter() - start, texts


def _median_rate(n: int, seconds: list[float]) -> float:
    return n / statistics.median(seconds)


def bench(files: list[Path], rounds: int, batch_size: int, workers: int, device: str) -> dict:
    from sat_model.captioner import Captioner

    with tempfile.TemporaryDirectory() as tmp:
        _lite0_model_dir(Path(tmp))
        captioner = Captioner.from_dir(tmp, beam_size=3, max_length=20, device=device)
    captioner.batch_size = batch_size
    list(captioner.caption_files(files[:batch_size], workers=workers))  # warm-up
    batched: list[float] = []
    single: list[float] = []
    for r in range(rounds):
        runs = [("batched", batched), ("single", single)]
        for name, times in runs if r % 2 == 0 else runs[::-1]:
            if name == "batched":
                seconds, texts_b = _batched(captioner, files, workers)
            else:
                seconds, texts_s = _one_at_a_time(captioner, files)
            times.append(seconds)
    same = sum(a == b for a, b in zip(texts_b, texts_s, strict=True)) / len(files)
    return {
        "images": len(files),
        "rounds": rounds,
        "batch_size": batch_size,
        "decode_workers": workers,
        "beam_size": 3,
        "max_length": 20,
        "batched_seconds": batched,
        "one_at_a_time_seconds": single,
        "batched_images_per_s": _median_rate(len(files), batched),
        "one_at_a_time_images_per_s": _median_rate(len(files), single),
        "speedup": statistics.median(single) / statistics.median(batched),
        # JPEGs decoded at reduced scale give slightly different pixels, so some captions of an
        # untrained model may differ
        "same_caption_fraction": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--flickr8k", type=Path, default=DEFAULT_FLICKR)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/caption.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, files = _photos(args.flickr8k, args.images, Path(tmp))
        figures = bench(files, args.rounds, args.batch_size, args.workers, args.device)
    result = {
        "source": source,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
        },
        "caption": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
