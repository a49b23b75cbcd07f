"""Model throughput: training captions/s (soft, hard) and batched against per-image beam search.

Writes JSON to stdout and ``benchmarks/results/model.json``. Dimensions as in docs/METHOD.md: ``B``
batch, ``T`` caption steps, ``L`` locations, ``D`` annotation size, ``m``/``n``/``A``
embedding/LSTM/attention sizes, ``K`` vocabulary size.

The fraction of peak compares the step's matmul FLOPs (counted analytically, backward taken as
twice the forward) with a large float32 matmul measured in the same run on the same threads,
through the BLAS and through oneDNN, whichever is faster (``matmul_flops``).

    .venv/bin/python benchmarks/bench_model.py [--quick]
    .venv/bin/python benchmarks/bench_model.py --device cuda   # the GPU rows, model_cuda.json
    .venv/bin/python benchmarks/bench_model.py --comparison --baseline /tmp/base  # beside main
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.settings import load_params
from sat_model.config import ATTENTION_KINDS, HardTrainConfig, ModelParams, SoftTrainConfig
from sat_model.data.vocab import END_ID, PAD_ID, START_ID
from sat_model.model.decoder import ModelConfig, ShowAttendTell
from sat_model.model.decoding import Caption, beam_search
from sat_model.model.factory import build_model
from sat_model.model.kernels import build_backend, native
from sat_model.model.losses import build_criterion
from sat_model.train.trainer import build_optimizer

__all__ = ["Dims", "load_tree", "main", "matmul_flops", "train_step_flops", "tutorial_loss"]

RESULTS = Path(__file__).resolve().parent / "results" / "model.json"


@dataclass(frozen=True)
class Dims:
    name: str
    L: int
    D: int
    m: int
    n: int
    A: int
    K: int


# the Flickr8k profile (profiles/flickr8k/params.yaml): Lite2's head at 260 px, 9x9x1280
FLICKR8K = Dims("flickr8k", 81, 1280, 256, 512, 256, 2500)
TUTORIAL = Dims("tutorial", 196, 512, 512, 512, 512, 2600)  # sgrvinod's tutorial's sizes
PAPER = Dims("paper", 196, 512, 512, 1800, 512, 10_000)


PEAK_SIZE = 2048  # the square float32 product whose rate is the peak


def matmul_flops(size: int = PEAK_SIZE, repeats: int = 5) -> dict[str, float]:
    """Best FLOP/s of a (size x size) @ (size x size) float32 product through each CPU backend:
    ``torch.mm`` (the BLAS, MKL in the pinned wheels) and, where PyTorch has it, oneDNN
    (``torch.utils.mkldnn``'s Linear, the kernel behind ``torch.lstm`` on CPU). MKL runs AMD
    CPUs well below their hardware, so the peak that fractions are taken of is the larger of
    the two."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    flops = {"blas": 2 * size**3 / _best_time(lambda: torch.mm(a, b), repeats)}
    if torch.backends.mkldnn.is_available():
        with warnings.catch_warnings():  # torch.utils.mkldnn still defines TorchScript modules
            warnings.simplefilter("ignore", FutureWarning)
            from torch.utils import mkldnn

            linear = torch.nn.Linear(size, size, bias=False).eval()
            with torch.no_grad():
                linear.weight.copy_(b.t())
            onednn = mkldnn.to_mkldnn(linear)
        with torch.inference_mode():
            onednn(a)  # warm-up
            flops["onednn"] = 2 * size**3 / _best_time(lambda: onednn(a), repeats)
    return flops


def cpu_bf16_matmul_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a (size x size) @ (size x size) bfloat16 product on the CPU (oneDNN;
    Intel's AMX tiles where the CPU has them, several times the float32 rate)."""
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm-up
    return 2 * size**3 / _best_time(lambda: torch.mm(a, b), repeats)


def train_step_flops(d: Dims, batch: int, steps: int) -> float:
    """Matmul FLOPs of one forward + backward over a batch (backward = 2 x forward)."""
    per_image = 2 * d.L * d.D * d.A + 2 * 2 * d.D * d.n  # W_a a once; h_0, c_0
    return 3.0 * batch * (per_image + steps * _step_flops(d))


def _step_flops(d: Dims) -> int:
    """Forward matmul FLOPs of one decoder step for one row."""
    return (
        2 * d.n * d.A  # W_h h_{t-1}
        + 2 * d.L * d.A  # w_att^T tanh(...)
        + 2 * d.L * d.D  # Σ α a
        + 2 * d.n  # f_β
        + 2 * (d.m + d.D + d.n) * 4 * d.n  # LSTM, Eq. 1
        + 2 * (d.n + d.D) * d.m  # L_h, L_z
        + 2 * d.m * d.K  # L_o
    )


def _best_time(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    """Fastest of ``repeats`` runs: the machine may be shared, and interference only adds. On a
    GPU each run is timed from an idle device to the end of its last kernel."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _captions(batch: int, steps: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T+1) with lengths spread over [T/2, T], like a length-bucketed minibatch."""
    words = torch.randint(END_ID + 2, vocab, (batch, steps + 1), generator=gen)
    words[:, 0] = START_ID
    lengths = torch.randint(steps // 2, steps + 1, (batch,), generator=gen)  # tokens after start
    for b, n in enumerate(lengths.tolist()):
        words[b, n] = END_ID
        words[b, n + 1 :] = PAD_ID
    return words


def bench_training(
    d: Dims,
    attention: str,
    batch: int,
    steps: int,
    iters: int,
    device: str = "cpu",
    autocast: torch.dtype | None = None,
) -> dict:
    """The trainer's step (``sat_model.train.trainer._train_epoch``): forward and loss under
    ``autocast`` where given (``train.mixed_precision``), backward, clipping, fused Adam."""
    gen = torch.Generator().manual_seed(0)
    params = ModelParams(embed_dim=d.m, hidden_dim=d.n, attention_dim=d.A)
    model = build_model(
        params, vocab_size=d.K, annotation_dim=d.D, num_locations=d.L, attention=attention
    ).to(device)
    cfg = SoftTrainConfig() if attention == "soft" else HardTrainConfig()
    criterion = build_criterion(attention, cfg).to(device)  # the hard loss keeps its baseline
    optimizer = build_optimizer(model.parameters(), "adam", lr=1e-4)
    annotations = torch.randn(batch, d.L, d.D, generator=gen).to(device)
    captions = _captions(batch, steps, d.K, gen).to(device)
    one_step = functools.partial(
        _train_once, model, criterion, optimizer, annotations, captions, autocast
    )
    one_step()  # warm-up
    seconds = _best_time(one_step, iters, device)
    return {
        "device": device,
        "autocast": str(autocast).removeprefix("torch.") if autocast else None,
        "dims": d.name,
        "attention": attention,
        "batch": batch,
        "steps": steps,
        "seconds_per_batch": seconds,
        "captions_per_s": batch / seconds,
        "matmul_flops_per_s": train_step_flops(d, batch, steps) / seconds,
    }


def _train_once(
    model: torch.nn.Module,
    criterion: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    annotations: torch.Tensor,
    captions: torch.Tensor,
    autocast: torch.dtype | None = None,
) -> None:
    """One step of the trainer: the loss under ``autocast`` where given, backward, clipping,
    the optimizer's step."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(annotations.device.type, autocast or torch.bfloat16, autocast is not None):
        loss = criterion(model(annotations, captions), captions).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()


def load_tree(root: str | Path) -> dict[str, ModuleType]:
    """Another checkout's ``sat_model`` (e.g. today's main beside this branch), imported into
    this process under its own module objects so both are timed in the same rounds: its
    decoder, decoding, losses, trainer and (where it has one) kernels modules. The current
    tree's ``sat_model`` stays the one ``import`` finds, so its models need their backend from
    :func:`baseline_model`."""
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "sat_model"}
    sys.path.insert(0, str(Path(root).resolve()))
    try:
        names = ("decoder", "decoding", "losses")
        tree = {n: importlib.import_module(f"sat_model.model.{n}") for n in names}
        with contextlib.suppress(ImportError):  # a tree from before the backend package
            tree["kernels"] = importlib.import_module("sat_model.model.kernels")
        tree["trainer"] = importlib.import_module("sat_model.train.trainer")
        tree["config"] = importlib.import_module("sat_model.config")
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if k.split(".")[0] == "sat_model"]:
            del sys.modules[k]
        sys.modules.update(ours)
    return tree


def baseline_model(tree: dict[str, ModuleType], fields: dict[str, Any]) -> Any:
    """A model of ``tree`` (``load_tree``) with that tree's own backend, built from its own
    kernels module (a decoder that imports its backend would find this tree's)."""
    config, kernels = tree["decoder"].ModelConfig(**fields), tree.get("kernels")
    if kernels is not None and hasattr(kernels, "FastBackend"):  # the decoder named it
        model = tree["decoder"].ShowAttendTell(config, backend="readable")
        model.backend = kernels.FastBackend()
        return model
    backend = None if kernels is None else kernels.build_backend("native")
    return tree["decoder"].ShowAttendTell(config, backend)


def tutorial_loss(
    model: ShowAttendTell, annotations: torch.Tensor, captions: torch.Tensor, lam: float
) -> torch.Tensor:
    """The plain reference, as the most-used PyTorch tutorial decodes (sgrvinod's
    a-PyTorch-Tutorial-to-Image-Captioning): captions sorted by length, and at each step only
    the captions still running (``batch_size_t``), the paper's equations unfused (Eq. 4-5, the
    gate, ``nn.LSTMCell``, Eq. 7) with ``model``'s parameters, W_a a once per batch; Eq. 14's
    loss per caption, averaged over captions."""
    att, targets = model.attention, captions[:, 1:]  # (B, T)
    lengths = (targets != PAD_ID).sum(1)
    lengths, order = lengths.sort(descending=True)
    a, targets = annotations[order], targets[order]  # (B, L, D), (B, T)
    embedded = model.embedding(captions[order, :-1])  # (B, T, m)
    projected = att.annotation_proj(a)  # (B, L, A)
    mean = a.mean(1)
    h, c = torch.tanh(model.init_h(mean)), torch.tanh(model.init_c(mean))  # (B, n)
    B, T = targets.shape
    logits = a.new_zeros(B, T, model.config.vocab_size)
    alphas = a.new_zeros(B, T, a.size(1))
    for t in range(int(lengths[0])):
        bt = int((lengths > t).sum())  # captions still running
        h, c = h[:bt], c[:bt]
        e = att.score(torch.tanh(projected[:bt] + att.hidden_proj(h).unsqueeze(1))).squeeze(2)
        alpha = torch.softmax(e, dim=1)  # (bt, L), Eq. 4-5
        assert model.gate is not None
        z = torch.sigmoid(model.gate(h)) * (alpha.unsqueeze(2) * a[:bt]).sum(1)  # (bt, D)
        emb = embedded[:bt, t]
        h, c = model.lstm(torch.cat([emb, z], dim=1), (h, c))  # Eq. 1-3
        pre = torch.tanh(emb + model.hidden_out(h) + model.context_out(z))  # Eq. 7
        logits[:bt, t] = model.out(F.dropout(pre, model.config.dropout, model.training))
        alphas[:bt, t] = alpha
    mask = targets != PAD_ID
    nll = F.cross_entropy(logits[mask], targets[mask], reduction="sum")  # packed, as theirs
    penalty = ((1.0 - alphas.sum(dim=1)) ** 2).sum(dim=1)  # (B,)
    return (nll + lam * penalty.sum()) / B


def _soft_fields(d: Dims) -> dict[str, Any]:
    """``ModelConfig``'s fields at ``d``'s sizes: soft attention with the gate, dropout 0.5."""
    return dict(
        vocab_size=d.K,
        annotation_dim=d.D,
        num_locations=d.L,
        embed_dim=d.m,
        hidden_dim=d.n,
        attention_dim=d.A,
        dropout=0.5,
        gate=True,
        attention="soft",
    )


def _interleaved_best(
    runs: Mapping[str, Callable[[], object]], rounds: int, device: str = "cpu"
) -> dict[str, float]:
    """Fastest time of each run over ``rounds`` interleaved rounds: this machine's speed drifts
    by tens of percent over seconds, and timing one way after the other would hand the drift
    to one side only."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], _best_time(run, 1, device))
    return best


def bench_against_reference(
    d: Dims,
    batch: int,
    rounds: int,
    doubly_stochastic: float = 1.0,
    device: str = "cpu",
    baseline: dict[str, ModuleType] | None = None,
) -> dict:
    """Training captions/s of the project's step (its native backend, and the
    readable model alone) against the tutorial's plain step (``tutorial_loss``) at
    the same sizes, soft attention with the doubly stochastic term, Adam, captions of 10-20
    words; with ``baseline`` (``load_tree``) also that tree's step. Interleaved rounds, best
    of each."""
    gen = torch.Generator().manual_seed(0)
    fields = _soft_fields(d)
    models = _reference_models(fields, device)
    criterion = build_criterion("soft", SoftTrainConfig(doubly_stochastic=doubly_stochastic)).to(
        device
    )
    annotations = torch.randn(batch, d.L, d.D, generator=gen).to(device)
    captions = _captions(batch, 20, d.K, gen).to(device)  # lengths 10-20 tokens after <start>
    steps = _reference_steps(models, criterion, annotations, captions, doubly_stochastic)
    if baseline is not None:
        steps["baseline"] = _baseline_training_step(
            baseline, fields, models["ours"], device, doubly_stochastic
        )(annotations, captions)
    product = torch.randn(PEAK_SIZE, PEAK_SIZE, device=device)
    steps["matmul_peak"] = lambda: torch.mm(product, product)  # the bound's peak, same rounds
    for step in steps.values():
        step()  # warm-up
    best = _interleaved_best(steps, rounds, device)
    row = _reference_row(d, batch, rounds, device, best)
    row["interleaved_matmul_peak_flops_per_s"] = 2 * PEAK_SIZE**3 / best["matmul_peak"]
    # the matmul work a step must do: the reference's, which computes only running captions
    row["necessary_matmul_flops"] = train_step_flops(d, batch, 0) + 3.0 * _step_flops(d) * int(
        (captions[:, 1:] != PAD_ID).sum()
    )
    return row


def _reference_models(fields: dict[str, Any], device: str) -> dict[str, ShowAttendTell]:
    """The models ``bench_against_reference`` times, all with the first one's weights: the
    native backend, the readable model, and the readable model the tutorial's step runs on."""
    config = ModelConfig(**fields)
    models = {
        "ours": ShowAttendTell(config, build_backend("native")).to(device),
        "readable": ShowAttendTell(config).to(device),
        "reference": ShowAttendTell(config).to(device),
    }
    for name in ("readable", "reference"):
        models[name].load_state_dict(models["ours"].state_dict())
    return models


def _reference_steps(
    models: dict[str, ShowAttendTell],
    criterion: torch.nn.Module,
    annotations: torch.Tensor,
    captions: torch.Tensor,
    doubly_stochastic: float,
) -> dict[str, Callable[[], None]]:
    """A training step of each of ``_reference_models``: the project's loss (with the native
    backend and without) and, for the reference, ``tutorial_loss``."""
    ours, readable, theirs = models["ours"], models["readable"], models["reference"]
    return {
        "ours": _adam_step(ours, lambda: criterion(ours(annotations, captions), captions).loss),
        "readable": _adam_step(
            readable, lambda: criterion(readable(annotations, captions), captions).loss
        ),
        "reference": _adam_step(
            theirs,
            lambda: tutorial_loss(theirs, annotations, captions, doubly_stochastic),
            fused=False,
        ),
    }


def _adam_step(
    model: torch.nn.Module, loss: Callable[[], torch.Tensor], fused: bool = True
) -> Callable[[], None]:
    """A training step of ``loss``: the project's optimizer (Adam, fused where torch has it)
    for the project's steps, torch's default Adam (``fused=False``) for the reference, as a
    plain implementation would write it."""
    if fused:
        opt = build_optimizer(model.parameters(), "adam", lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return step


def _reference_row(d: Dims, batch: int, rounds: int, device: str, best: dict[str, float]) -> dict:
    """``bench_against_reference``'s row from the best seconds of each step."""
    row = {
        "device": device,
        "dims": d.name,
        "batch": batch,
        "rounds": rounds,
        "native_kernels": native.load() is not None,
        "captions_per_s": batch / best["ours"],
        "readable_captions_per_s": batch / best["readable"],
        "reference_captions_per_s": batch / best["reference"],
        "speedup_over_reference": best["reference"] / best["ours"],
        "readable_speedup_over_reference": best["reference"] / best["readable"],
        "matmul_flops_per_s": train_step_flops(d, batch, 20) / best["ours"],
    }
    if "baseline" in best:
        row["baseline_captions_per_s"] = batch / best["baseline"]
        row["over_baseline"] = best["baseline"] / best["ours"]
        row["baseline_speedup_over_reference"] = best["reference"] / best["baseline"]
    return row


def _baseline_training_step(
    tree: dict[str, ModuleType],
    fields: dict,
    ours: torch.nn.Module,
    device: str,
    doubly_stochastic: float,
) -> Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]:
    """The same training step through another tree's modules, with ``ours``'s weights."""
    model = baseline_model(tree, fields).to(device)
    model.load_state_dict(ours.state_dict())
    cfg = tree["config"].SoftTrainConfig(doubly_stochastic=doubly_stochastic)
    criterion = tree["losses"].build_criterion("soft", cfg).to(device)
    opt = tree["trainer"].build_optimizer(model.parameters(), "adam", lr=1e-4)

    def bind(annotations: torch.Tensor, captions: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            criterion(model(annotations, captions), captions).loss.backward()
            opt.step()

        return step

    return bind


def bench_beam(
    d: Dims,
    images: int,
    beam: int,
    max_length: int,
    device: str = "cpu",
    rounds: int = 10,
    dtype: torch.dtype = torch.float32,
    baseline: dict[str, ModuleType] | None = None,
    compiled: bool = False,
) -> dict:
    """Batched beam search over ``images`` against one image at a time, same model and
    annotations, interleaved rounds. ``dtype`` other than float32: the model and annotations
    cast to it (the compiled kernels are float32-only, so both ways run PyTorch's ops); the row
    then also counts the images whose batched caption equals the float32 model's. With
    ``baseline`` (``load_tree``), that tree's batched search on the same weights too; with
    ``compiled``, the batched search through the backend's ``torch.compile``'d step, its
    compile time and whether its captions are the readable step's."""
    torch.manual_seed(0)
    fields = _soft_fields(d)
    model = ShowAttendTell(ModelConfig(**fields), build_backend("native")).to(device)
    with torch.no_grad():
        model.out.bias[END_ID] = -1e4  # every caption runs to max_length: equal work both ways
    annotations = torch.randn(images, d.L, d.D, device=device)
    float32_captions = None
    if dtype != torch.float32:
        float32_captions = beam_search(model, annotations, beam, max_length)
        model, annotations = model.to(dtype), annotations.to(dtype)
    beam_search(model, annotations[:2], beam, max_length)  # warm-up
    batched = beam_search(model, annotations, beam, max_length)
    single = [beam_search(model, a.unsqueeze(0), beam, max_length)[0] for a in annotations]
    runs = _beam_runs(model, annotations, beam, max_length, device)
    row: dict = {}
    if compiled:
        runs["compiled"], row = _compiled_beam_run(model, annotations, beam, max_length, batched)
    if baseline is not None:
        runs["baseline"] = _baseline_beam_run(
            baseline, fields, model, annotations, beam, max_length
        )
    best = _interleaved_best(runs, rounds, device)
    same = _same_captions(batched, single)
    if compiled:
        row["batched_compiled_captions_per_s"] = images / best["compiled"]
        row["batched_compiled_over_batched"] = best["batched"] / best["compiled"]
    if baseline is not None:
        row["baseline_batched_captions_per_s"] = images / best["baseline"]
        row["batched_over_baseline"] = best["baseline"] / best["batched"]
        if compiled:
            row["batched_compiled_over_baseline"] = best["baseline"] / best["compiled"]
    if float32_captions is not None:
        row["images_with_the_same_caption_both_ways"] = same
        row["images_with_the_float32_caption"] = _same_captions(batched, float32_captions)
    return row | _beam_row(d, images, beam, max_length, device, rounds, dtype, best, same)


def _beam_runs(
    model: ShowAttendTell, annotations: torch.Tensor, beam: int, max_length: int, device: str
) -> dict[str, Callable[[], object]]:
    """Batched beam search, the same through the readable model (on the CPU only: the kernels
    are CPU code, elsewhere both runs are the same) and one image at a time."""
    readable = ShowAttendTell(model.config)
    readable = readable.to(device=annotations.device, dtype=annotations.dtype)
    readable.load_state_dict(model.state_dict())
    readable.train(model.training)

    def batched() -> object:
        return beam_search(model, annotations, beam, max_length)

    def batched_readable() -> object:
        return beam_search(readable, annotations, beam, max_length)

    def one_at_a_time() -> object:
        return [beam_search(model, a.unsqueeze(0), beam, max_length) for a in annotations]

    runs: dict[str, Callable[[], object]] = {"batched": batched}
    if device == "cpu":
        runs["readable"] = batched_readable
    runs["one_at_a_time"] = one_at_a_time
    return runs


def _compiled_beam_run(
    model: ShowAttendTell,
    annotations: torch.Tensor,
    beam: int,
    max_length: int,
    readable_captions: list[Caption],
) -> tuple[Callable[[], object], dict]:
    """Batched beam search through ``model``'s weights with the step compiled
    (``compile_decoding``), and a row of its first call's seconds (the compile), its second's
    (a new batch size, compiled again, and the whole search) and whether its captions are
    ``readable_captions``."""
    compiled = _compiled_decoding_model(model).to(device=annotations.device)
    start = time.perf_counter()
    beam_search(compiled, annotations[:2], beam, max_length)
    first = time.perf_counter() - start
    start = time.perf_counter()
    captions = beam_search(compiled, annotations, beam, max_length)
    row = {
        "decoding_compile_s": first,
        "decoding_second_call_s": time.perf_counter() - start,
        "compiled_same_captions": _same_captions(captions, readable_captions) == len(captions),
    }
    return lambda: beam_search(compiled, annotations, beam, max_length), row


def _baseline_beam_run(
    tree: dict[str, ModuleType],
    fields: dict[str, Any],
    model: ShowAttendTell,
    annotations: torch.Tensor,
    beam: int,
    max_length: int,
) -> Callable[[], object]:
    """Batched beam search through another tree's modules (``load_tree``), with ``model``'s
    weights on the annotations' device and dtype; warmed up."""
    other = baseline_model(tree, fields)
    other = other.to(device=annotations.device, dtype=annotations.dtype)
    other.load_state_dict(model.state_dict())
    other_search = tree["decoding"].beam_search
    other_search(other, annotations[:2], beam, max_length)  # warm-up

    def run() -> object:
        return other_search(other, annotations, beam, max_length)

    return run


def _same_captions(ours: list[Caption], theirs: list[Caption]) -> int:
    """How many images have the same caption (tokens) both ways."""
    return sum(x.tokens == y.tokens for x, y in zip(ours, theirs, strict=True))


def _beam_row(
    d: Dims,
    images: int,
    beam: int,
    max_length: int,
    device: str,
    rounds: int,
    dtype: torch.dtype,
    best: dict[str, float],
    same: int,
) -> dict:
    """``bench_beam``'s row from the best seconds of each run and the count of images whose
    batched caption is the one-at-a-time one."""
    batched_s, single_s = best["batched"], best["one_at_a_time"]
    readable_s = best.get("readable", 0.0)
    # one row per image at the first step, then all B*k rows (<end> is unreachable here)
    row_steps = images * (1 + beam * (max_length - 1))
    return {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "dims": d.name,
        "images": images,
        "beam_size": beam,
        "max_length": max_length,
        "rounds": rounds,
        "native_kernels": native.load() is not None,
        "batched_captions_per_s": images / batched_s,
        "batched_readable_captions_per_s": images / readable_s if readable_s else None,
        "one_at_a_time_captions_per_s": images / single_s,
        "speedup": single_s / batched_s,
        "batched_native_over_readable": readable_s / batched_s if readable_s else None,
        "batched_matmul_flops_per_s": row_steps * _step_flops(d) / batched_s,
        "batched_matmul_flops": row_steps * _step_flops(d),
        "one_at_a_time_s": single_s,
        "same_captions": same == images,
    }


def bench_compiled(d: Dims, batch: int, rounds: int, beam_images: int) -> dict:
    """The native backend against ``torch.compile`` of the readable code it stands in for
    (Inductor's CPU backend) and against the readable code itself: the training recurrence
    (soft, forward and backward of the loss; the kept kernel; compiled: ``advance`` and
    ``deep_output``, the equations of a step) and decoding (batched beam search; no kernel
    kept, so native is the readable code there; compiled: the backend's ``compile_decoding``).
    Interleaved rounds, best of each; each compile time apart. Where Inductor cannot compile,
    the error instead. A kernel pays where ``native_over_compiled`` is at least 1.3."""
    models = _compiled_models(d)
    decoding_models = models | {"compiled": _compiled_decoding_model(models["native"])}
    criterion = build_criterion("soft", SoftTrainConfig())
    gen = torch.Generator().manual_seed(0)
    annotations = torch.randn(batch, d.L, d.D, generator=gen)
    captions = _captions(batch, 20, d.K, gen)
    images = annotations[:beam_images]
    pieces = {
        "training_recurrence": (batch, _training_pass, (criterion, annotations, captions), models),
        "decoding": (beam_images, _beam_pass, (images,), decoding_models),
    }
    row: dict = {"dims": d.name, "batch": batch, "beam_images": beam_images, "rounds": rounds}
    runs: dict[str, Callable[[], None]] = {}
    for piece, (_, make, args, piece_models) in pieces.items():
        for name, model in piece_models.items():
            runs[f"{piece}/{name}"] = make(model, *args)  # type: ignore[operator]
        try:
            start = time.perf_counter()
            runs[f"{piece}/compiled"]()
            row[f"{piece}_compile_s"] = time.perf_counter() - start
        except Exception as exc:  # Inductor's own errors have no common base
            return row | {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    for run in runs.values():
        run()  # warm-up
    best = _interleaved_best(runs, rounds)
    for piece, (count, _, _, _) in pieces.items():
        rates = {name: count / best[f"{piece}/{name}"] for name in models}
        row[piece] = {f"{name}_per_s": rate for name, rate in rates.items()} | {
            "native_over_compiled": rates["native"] / rates["compiled"],
            "native_over_readable": rates["native"] / rates["readable"],
        }
    return row


def _compiled_models(d: Dims) -> dict[str, ShowAttendTell]:
    """The native backend's model, the readable one with its weights, and the readable one
    with its step's equations (``advance``, ``deep_output``) wrapped by ``torch.compile``,
    compiled at their first call."""
    torch.manual_seed(0)
    config = ModelConfig(**_soft_fields(d))
    native_model = ShowAttendTell(config, build_backend("native"))
    models = {"native": native_model, "readable": ShowAttendTell(config)}
    models["compiled"] = compiled = ShowAttendTell(config)
    # one graph per shape, mode and grad mode: beam search's first step has B rows, the
    # others B*k; training and decoding differ in dropout and autograd
    torch._dynamo.config.recompile_limit = 64
    compiled.advance = torch.compile(compiled.advance)  # type: ignore[method-assign]
    compiled.deep_output = torch.compile(compiled.deep_output)  # type: ignore[method-assign]
    for model in models.values():
        model.load_state_dict(native_model.state_dict())
    return models


def _compiled_decoding_model(native_model: ShowAttendTell) -> ShowAttendTell:
    """``native_model``'s weights and dtype behind the native backend with
    ``compile_decoding``."""
    model = ShowAttendTell(native_model.config, build_backend("native", compile_decoding=True))
    model.load_state_dict(native_model.state_dict())
    # compiled afresh, as in a process of one model: sizes left from another row would make
    # the step's dimensions dynamic, and its batch sizes would outrun torch's 8 recompiles
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64
    return model.to(next(native_model.parameters()).dtype)


def _training_pass(
    model: ShowAttendTell,
    criterion: torch.nn.Module,
    annotations: torch.Tensor,
    captions: torch.Tensor,
) -> Callable[[], None]:
    """Forward and backward of the loss over the batch, no optimizer step."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        criterion(model(annotations, captions), captions).loss.backward()

    return step


def _beam_pass(model: ShowAttendTell, images: torch.Tensor) -> Callable[[], None]:
    """Batched beam search (beam 3, 20 words) over ``images``, the model left in training mode."""

    def run() -> None:
        with torch.no_grad():
            beam_search(model.eval(), images, 3, 20)
        model.train()

    return run


def speedup_bound(beam: dict, peak: float) -> float:
    """The batched/one-at-a-time ratio if the batched search did nothing but its matrix
    products, at ``peak`` FLOP/s, against the one-at-a-time time measured: an upper bound
    for this machine (the attention, the softmax and the beams' bookkeeping add to it)."""
    return float(beam["one_at_a_time_s"] / (beam["batched_matmul_flops"] / peak))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command-line options; the module docstring shows the usual runs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, default dims only")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--beam-images", type=int, default=None, help="images per batch (default eval.batch_size)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: the training and beam search rows on the GPU, float32 and bf16 autocast "
        "(benchmarks/results/model_cuda.json)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="another checkout's root (e.g. `git worktree add /tmp/base <commit>`): its training "
        "step and batched beam search timed in the same rounds",
    )
    parser.add_argument(
        "--comparison",
        action="store_true",
        help="only the rows against the tutorial's reference and the baseline, at the "
        "tutorial's, the default and the paper's sizes (benchmarks/results/model_comparison.json)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="only torch.compile of the readable step against the hand-written backend, at the "
        "default, the Flickr8k profile's and the paper's sizes (model_compiled.json)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """The rows the options ask for, at the default sizes (the params file's model, 14x14x112
    features, 100 words) and, by option, others; written to ``benchmarks/results/``."""
    args = _parse_args(argv)
    params = load_params(args.params)
    mp = params.model
    beam_images = args.beam_images or params.eval.batch_size
    default = Dims("default", 196, 112, mp.embed_dim, mp.hidden_dim, mp.attention_dim, 100)
    if args.device == "cuda":
        return _main_cuda(default, beam_images)
    baseline = load_tree(args.baseline) if args.baseline else None
    if args.comparison:
        return comparison(default, beam_images, args.rounds, baseline)
    if args.compiled:
        rows = [bench_compiled(d, 64, args.rounds, beam_images) for d in (default, FLICKR8K, PAPER)]
        _write_json(RESULTS.with_name("model_compiled.json"), rows)
        return {"compiled": rows}
    return _main_cpu([default] if args.quick else [default, PAPER], beam_images, args.quick)


def _main_cpu(dims: list[Dims], beam_images: int, quick: bool) -> dict:
    """The CPU rows (``model.json``): training captions/s, the reference comparison, f_att's
    nonlinearity, the LSTM kernels and beam search, against the float32 matmul peak; without
    ``quick`` also beam search at the paper's sizes and in bfloat16."""
    backends = matmul_flops()
    peak = max(backends.values())
    training = _training_rows(dims, quick, peak)
    against_reference = _against_reference_rows(dims[0], quick, peak)
    result: dict = {
        "training_against_reference": against_reference,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "matmul_peak_flops_per_s": peak,
        "matmul_flops_per_s_by_backend": backends,
        "dims": [asdict(d) for d in dims],
        "training": training,
        "beam_search": bench_beam(dims[0], images=beam_images, beam=3, max_length=20),
    }
    if not quick:  # one-image decoding at the paper's sizes: the slowest row
        result["beam_search_paper"] = bench_beam(
            dims[1], images=beam_images, beam=3, max_length=20, rounds=2
        )
    for key in ("beam_search", "beam_search_paper"):
        if key in result:
            _add_float32_bound(result[key], peak)
    if not quick:  # bfloat16 (AMX where the CPU has it): faster products, other rounding
        result |= _bf16_beam_rows(dims, beam_images)
    if torch.cuda.is_available():  # the same comparison where a GPU is present
        result["beam_search_gpu"] = bench_beam(
            dims[0], images=beam_images, beam=3, max_length=20, device="cuda"
        )
    _write_json(RESULTS, result)
    return result


def _training_rows(dims: list[Dims], quick: bool, peak: float) -> list[dict]:
    """``bench_training`` for each size and attention, with its fraction of ``peak``."""
    rows = []
    for d in dims:
        iters = 3 if quick or d.name == "paper" else 5
        for attention in ATTENTION_KINDS:
            row = bench_training(d, attention, batch=64, steps=16, iters=iters)
            row["fraction_of_matmul_peak"] = row["matmul_flops_per_s"] / peak
            rows.append(row)
    return rows


def _against_reference_rows(default: Dims, quick: bool, peak: float) -> list[dict]:
    """``bench_against_reference`` at the default sizes (and, without ``quick``, the
    tutorial's), with its fraction of ``peak``."""
    rows = []
    for d in [default] if quick else [default, TUTORIAL]:
        row = bench_against_reference(d, batch=64, rounds=2 if quick else 3)
        _add_training_bound(row, peak)
        rows.append(row)
    return rows


def _bf16_beam_rows(dims: list[Dims], beam_images: int) -> dict:
    """The bfloat16 matmul peak and ``bench_beam`` in bfloat16 at each size, with its speedup
    bound at that peak."""
    bf16_peak = cpu_bf16_matmul_flops()
    rows = [
        bench_beam(d, beam_images, 3, 20, rounds=3 if d is dims[0] else 1, dtype=torch.bfloat16)
        for d in dims
    ]
    for beam in rows:
        beam["speedup_bound_at_bf16_matmul_peak"] = speedup_bound(beam, bf16_peak)
    return {"matmul_bf16_flops_per_s": bf16_peak, "beam_search_bf16": rows}


def _add_training_bound(row: dict, peak: float) -> None:
    """A ``bench_against_reference`` row's step as a fraction of the float32 matmul ``peak``
    (its own products, every padded step), and the speedup over the reference that a step doing
    only the necessary products (running captions) at that peak would reach: an upper bound.
    The peak is the larger of ``peak`` and the product timed in the row's own rounds."""
    peak = max(peak, row["interleaved_matmul_peak_flops_per_s"])
    row["fraction_of_matmul_peak"] = row["matmul_flops_per_s"] / peak
    reference_s = row["batch"] / row["reference_captions_per_s"]
    row["speedup_bound_at_float32_matmul_peak"] = reference_s / (
        row["necessary_matmul_flops"] / peak
    )


def _add_float32_bound(beam: dict, peak: float) -> None:
    """A ``bench_beam`` row's batched search as a fraction of the float32 matmul ``peak``, and
    its speedup bound at that peak."""
    beam["batched_fraction_of_matmul_peak"] = beam["batched_matmul_flops_per_s"] / peak
    beam["speedup_bound_at_float32_matmul_peak"] = speedup_bound(beam, peak)


def _write_json(path: Path, data: object) -> None:
    """``data`` as indented JSON to ``path`` (its folder made where missing) and to stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(data, indent=2))


def comparison(
    default: Dims, beam_images: int, rounds: int, baseline: dict[str, ModuleType] | None
) -> dict:
    """Training against the tutorial's plain step at the tutorial's, the default and the
    paper's sizes, and batched beam search (eager and with the step compiled) against one
    image at a time at the default, the tutorial's and the Flickr8k profile's sizes, each
    beside ``baseline``'s where given, with its fraction of the float32 matmul bound."""
    backends = matmul_flops()
    peak = max(backends.values())
    result: dict = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "matmul_peak_flops_per_s": peak,
        "training_against_reference": [
            bench_against_reference(d, 64, rounds, baseline=baseline)
            for d in (TUTORIAL, default, PAPER)
        ],
        "beam_search": [
            bench_beam(d, beam_images, 3, 20, rounds=rounds, baseline=baseline, compiled=True)
            for d in (default, TUTORIAL, FLICKR8K)
        ],
        # what keeps each hand-written piece: its ratio over compiled readable code
        "kept_over_compiled": bench_compiled(FLICKR8K, 64, rounds, beam_images),
    }
    for row in result["training_against_reference"]:
        _add_training_bound(row, peak)
    for beam in result["beam_search"]:
        _add_float32_bound(beam, peak)
    _write_json(RESULTS.with_name("model_comparison.json"), result)
    return result


def cuda_matmul_flops(size: int = 8192, repeats: int = 5) -> dict[str, float]:
    """Best FLOP/s of a (size x size) @ (size x size) product on the GPU: float32 (TF32 off, as
    PyTorch's default leaves it) and bfloat16."""
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(size, size, device="cuda", dtype=dtype)
        b = torch.randn(size, size, device="cuda", dtype=dtype)
        torch.mm(a, b)  # warm-up
        out[name] = 2 * size**3 / _best_time(lambda a=a, b=b: torch.mm(a, b), repeats, "cuda")
    return out


def _main_cuda(default: Dims, beam_images: int) -> dict:
    """The GPU rows: training captions/s in float32 and under bf16 autocast
    (``train.mixed_precision``), the reference comparison, and batched against per-image beam
    search, at the default, the Flickr8k profile's, the tutorial's and the paper's sizes."""
    peaks = cuda_matmul_flops()
    training = []
    for d in (default, FLICKR8K, TUTORIAL, PAPER):
        for attention in ATTENTION_KINDS:
            for autocast in (None, torch.bfloat16):
                row = bench_training(d, attention, 64, 16, 10, "cuda", autocast)
                peak = peaks["bfloat16" if autocast else "float32"]
                row["fraction_of_matmul_peak"] = row["matmul_flops_per_s"] / peak
                training.append(row)
    result = {
        "device": "cuda",
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "matmul_flops_per_s": peaks,
        "training": training,
        "training_against_reference": [
            bench_against_reference(d, batch=64, rounds=5, device="cuda")
            for d in (default, TUTORIAL)
        ],
        "beam_search": [
            bench_beam(d, images=beam_images, beam=3, max_length=20, device="cuda", rounds=3)
            for d in (default, FLICKR8K, PAPER)
        ],
    }
    _write_json(RESULTS.with_name("model_cuda.json"), result)
    return result


if __name__ == "__main__":
    main()
