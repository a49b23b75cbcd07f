"""Evaluation figures: scoring time for 1,000 images × 5 references with every metric (METEOR's
Java start included), and captioning throughput of image files (what ``sat caption`` does).

Data: the Flickr8k sample (``../shared/data/flickr8k-sample`` beside the repository, or
``--flickr8k``) when present,
else synthetic scenes. Hypotheses are another image's human caption, so the scores are those of
a plausible but unrelated caption. The captioning model is untrained (beam search costs the same
whatever the weights) over the default EfficientNet-Lite0 encoder.

    .venv/bin/python benchmarks/bench_eval.py [--images 1000] [--caption-images 64]

JSON to stdout and ``benchmarks/results/eval.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from sat_model.paths import shared_data

DEFAULT_FLICKR = shared_data("flickr8k-sample")


def _flickr_references(root: Path, n: int) -> tuple[dict[str, list[str]], list[Path]]:
    refs: dict[str, list[str]] = {}
    for line in (root / "Flickr8k_text" / "Flickr8k.token.txt").read_text().splitlines():
        key, _, caption = line.partition("\t")
        refs.setdefault(key.split("#")[0], []).append(caption)
    ids = sorted(i for i, r in refs.items() if len(r) >= 5)[:n]
    return {i: refs[i][:5] for i in ids}, [root / "Flickr8k_Dataset" / i for i in ids]


def _synthetic_references(n: int, folder: Path) -> tuple[dict[str, list[str]], list[Path]]:
    from sat_model.data.scenes import generate_scene, render_scene

    refs, files = {}, []
    for i in range(n):
        scene = generate_scene(seed=0, split="test", index=i, image_size=224)
        refs[scene.image_id] = list(scene.captions)[:5]
        if len(files) < 256:
            path = folder / f"{scene.image_id}.png"
            render_scene(scene).save(path)
            files.append(path)
    return refs, files


def bench_scoring(refs: dict[str, list[str]]) -> dict[str, float]:
    from sat_model.evaluation.metrics import score_captions

    ids = list(refs)
    # each image gets the first caption of the next image: fluent, unrelated
    hyps = {i: refs[ids[(k + 1) % len(ids)]][0] for k, i in enumerate(ids)}
    start = time.perf_counter()
    scores = score_captions(hyps, refs)
    return {"scoring_seconds": time.perf_counter() - start, "images": len(ids), **scores}


def _lite0_model_dir(directory: Path) -> None:
    from sat_model.config import ModelParams
    from sat_model.data.vocab import Vocab
    from sat_model.features.encoders import build_encoder
    from sat_model.model.checkpoint import save_checkpoint
    from sat_model.model.factory import build_model

    d = build_encoder("efficientnet_lite0").spec
    vocab = Vocab(
        ("<pad>", "<start>", "<end>", "<unk>", *[f"w{i}" for i in range(996)]), 1, 10_000, 20
    )
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


def bench_captioning(files: list[Path], beam_size: int, max_length: int) -> dict[str, float]:
    import torch

    from sat_model.captioner import Captioner

    with tempfile.TemporaryDirectory() as tmp:
        _lite0_model_dir(Path(tmp))
        captioner = Captioner.from_dir(tmp, beam_size=beam_size, max_length=max_length)
    prep = captioner.preprocessing
    captioner.caption_pixels(prep.pixels(files[0])[None])  # warm-up
    start = time.perf_counter()
    captioner.caption_pixels(torch.stack([prep.pixels(f) for f in files]))
    seconds = time.perf_counter() - start
    return {
        "caption_images": len(files),
        "caption_seconds": seconds,
        "caption_images_per_s": len(files) / seconds,
        "beam_size": beam_size,
        "max_length": max_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--caption-images", type=int, default=64)
    parser.add_argument("--beam-size", type=int, default=3)
    parser.add_argument("--flickr8k", type=Path, default=DEFAULT_FLICKR)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/eval.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if (args.flickr8k / "Flickr8k_text").is_dir():
            source = "flickr8k-sample"
            refs, files = _flickr_references(args.flickr8k, args.images)
        else:
            source = "synthetic"
            refs, files = _synthetic_references(args.images, Path(tmp))
        result = {
            "source": source,
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
                "cuda": torch.cuda.is_available(),
            },
            "scoring": bench_scoring(refs),
            "captioning": bench_captioning(files[: args.caption_images], args.beam_size, 20),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
