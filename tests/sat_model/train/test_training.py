"""The training loop: determinism, early stopping, non-finite losses, schedules, callbacks."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sat_model.data.vocab import build_vocab
from sat_model.model.checkpoint import (
    LAST_STATE_FILE,
    Checkpoint,
    CheckpointError,
    TrainingState,
    load_checkpoint,
    save_checkpoint,
)
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.losses import SoftAttentionLoss
from sat_model.train.batching import Batch
from sat_model.train.optim import build_optimizer, build_scheduler
from sat_model.train.run import TrainFolders, Worker
from sat_model.train.trainer import (
    Callback,
    EpochState,
    FitOptions,
    NonFiniteLossError,
    Objective,
    ResumeState,
    fit,
)
from tests.factories import model_config, to_format_1, write_captions

L, D, K = 4, 6, 12


CPU = Worker(device="cpu")  # the same floats on a machine with a GPU


def _model(seed: int = 0) -> ShowAttendTell:
    torch.manual_seed(seed)
    return ShowAttendTell(
        model_config(
            vocab_size=K,
            annotation_dim=D,
            num_locations=L,
            hidden_dim=10,
            attention_dim=6,
            dropout=0.5,
        )
    )


def _batches(num: int = 4, nan_at_epoch: int | None = None):
    gen = torch.Generator().manual_seed(123)
    data = []
    for i in range(num):
        T = 3 + i % 2
        captions = torch.randint(4, K, (5, T + 1), generator=gen)
        captions[:, 0], captions[:, -1] = 1, 2
        data.append((torch.randn(5, L, D, generator=gen), captions))

    def batches(epoch: int) -> list[Batch]:
        out = []
        for feats, captions in data:
            if epoch == nan_at_epoch:
                feats = torch.full_like(feats, float("nan"))
            out.append(Batch(feats, captions, torch.full((5,), captions.size(1)), torch.arange(5)))
        return out

    return batches


class Recorder(Callback):
    def __init__(self) -> None:
        self.states: list[EpochState] = []
        self.weights: list[torch.Tensor] = []
        self.logs: list[tuple[int, int, float]] = []
        self.saved: list[dict] = []  # what a checkpoint callback would write at each epoch's end

    def on_log(self, epoch: int, step: int, loss: float) -> None:
        self.logs.append((epoch, step, loss))

    def on_epoch_end(self, state: EpochState) -> None:
        self.states.append(state)
        self.saved.append(state.checkpoint())
        self.weights.append(self.saved[-1]["model_state"]["out.weight"].clone())


def _fit(
    model,
    validate=None,
    callbacks=(),
    *,
    seed=7,
    max_epochs=1,
    patience=3,
    batches=None,
    schedule="constant",
    lr=1e-2,
    autocast_dtype=None,
):
    optimizer = build_optimizer(model.parameters(), "adam", lr)
    return fit(
        model,
        Objective(
            SoftAttentionLoss(1.0), optimizer, build_scheduler(optimizer, schedule, max_epochs, 0.5)
        ),
        batches or _batches(),
        validate,
        FitOptions(
            max_epochs=max_epochs,
            patience=patience,
            grad_clip=5.0,
            seed=seed,
            log_every=2,
            autocast_dtype=autocast_dtype,
        ),
        callbacks,
    )


def test_same_seed_gives_identical_parameters_after_an_epoch() -> None:
    a, b = _model(), _model()
    _fit(a)
    _fit(b)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    # the check can fail: another dropout seed moves the parameters
    c = _model()
    _fit(c, seed=8)
    assert not torch.equal(a.out.weight, c.out.weight)


@pytest.mark.parametrize(
    "dtype",
    [
        None,
        torch.bfloat16,
    ],
)
def test_bf16_autocast_runs_the_forward_pass_in_bf16_and_trains_float32_weights(dtype) -> None:
    model = _model()
    seen: list[torch.dtype] = []
    model.out.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    before = model.out.weight.detach().clone()
    rec = Recorder()
    _fit(model, None, [rec], autocast_dtype=dtype)
    assert set(seen) == {dtype or torch.float32}  # every training step, under autocast or not
    assert math.isfinite(rec.states[0].train_loss)
    assert model.out.weight.dtype == torch.float32
    assert not torch.equal(model.out.weight, before)  # the optimiser stepped


def test_epoch_state_counts_the_captions_trained_on_and_the_training_time() -> None:
    rec = Recorder()
    _fit(_model(), lambda m: {"bleu_4": 0.5}, [rec], max_epochs=1)
    (state,) = rec.states
    assert state.captions == 4 * 5  # _batches: 4 batches of 5 captions
    assert 0 < state.train_seconds <= state.seconds


def test_training_lowers_the_loss_on_a_fixed_batch_set() -> None:
    rec = Recorder()
    _fit(_model(), callbacks=[rec], max_epochs=4)
    assert rec.states[-1].train_loss < rec.states[0].train_loss


def test_early_stopping_stops_after_patience_epochs_without_improvement() -> None:
    scores = iter([0.10, 0.30, 0.20, 0.25, 0.29, 0.90, 0.95])
    rec = Recorder()
    model = _model()
    result = _fit(model, lambda m: {"bleu_4": next(scores)}, [rec], max_epochs=7, patience=3)
    # best at epoch 2; epochs 3, 4, 5 do not beat it -> stop after epoch 5
    assert [s.epoch for s in rec.states] == [1, 2, 3, 4, 5]
    assert [s.is_best for s in rec.states] == [True, True, False, False, False]
    assert (result.best_epoch, result.best_score) == (2, 0.30)
    assert result.stopped_early and result.epochs_completed == 5
    # the model is left holding the best epoch's weights, not the last
    assert torch.equal(model.out.weight, rec.weights[1])
    assert not torch.equal(model.out.weight, rec.weights[-1])


def test_without_validation_training_runs_every_epoch() -> None:
    rec = Recorder()
    result = _fit(_model(), None, [rec], max_epochs=3, patience=1)
    assert [s.epoch for s in rec.states] == [1, 2, 3]
    assert all(s.val_metrics is None for s in rec.states)
    assert not result.stopped_early and result.epochs_completed == 3


def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    vocab = build_vocab([[f"w{i}" for i in range(K - 4)]], 1, 100, 20)

    class Saver(Callback):
        def on_epoch_end(self, state: EpochState) -> None:
            ckpt = state.checkpoint()
            save_checkpoint(
                tmp_path,
                model_config=model.config,
                vocab=vocab,
                model_state=ckpt["model_state"],
                training=TrainingState(epoch=ckpt["epoch"]),
            )

    model, rec = _model(), Recorder()
    with pytest.raises(NonFiniteLossError, match="nan at epoch 3"):
        _fit(model, None, [rec, Saver()], max_epochs=5, batches=_batches(nan_at_epoch=2))
    assert [s.epoch for s in rec.states] == [1, 2]  # no callback saw the bad epoch
    saved = load_checkpoint(tmp_path, training=True)
    assert saved.training is not None and saved.training.epoch == 2
    assert all(torch.isfinite(t).all() for t in saved.model_state.values())
    assert torch.equal(saved.model_state["out.weight"], rec.weights[-1])


def test_huge_learning_rate_that_diverges_is_reported_as_non_finite() -> None:
    model = _model()
    with torch.no_grad():
        model.out.weight.fill_(1e38)  # logits overflow to inf: the loss cannot stay finite
    with pytest.raises(NonFiniteLossError):
        _fit(model, max_epochs=2, lr=1e30)


def test_step_schedule_multiplies_the_rate_each_epoch() -> None:
    rec = Recorder()
    _fit(_model(), None, [rec], max_epochs=3, schedule="step", lr=1e-2)
    assert [s.lr for s in rec.states] == pytest.approx([1e-2, 5e-3, 2.5e-3])


def test_cosine_schedule_follows_the_half_cosine() -> None:
    rec = Recorder()
    _fit(_model(), None, [rec], max_epochs=4, schedule="cosine", lr=1e-2)
    expected = [1e-2 * (1 + math.cos(math.pi * e / 4)) / 2 for e in range(4)]
    assert [s.lr for s in rec.states] == pytest.approx(expected)


def test_progress_is_logged_every_n_steps_with_the_window_mean() -> None:
    rec = Recorder()
    _fit(_model(), None, [rec], max_epochs=1)
    assert [(e, s) for e, s, _ in rec.logs] == [(0, 2), (0, 4)]
    window_means = [loss for *_, loss in rec.logs]
    assert sum(window_means) / 2 == pytest.approx(rec.states[0].train_loss, rel=1e-5)


def test_unknown_optimizer_and_schedule_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sgd"):
        build_optimizer(_model().parameters(), "sgd", 1e-3)
    opt = build_optimizer(_model().parameters(), "rmsprop", 1e-3)
    with pytest.raises(ValueError, match="linear"):
        build_scheduler(opt, "linear", 3, 0.5)


def _fit_ema(model, epochs, *, start_epoch=0, average_state=None, optimizer_state=None):
    """``ema_decay`` 0.8, 4 steps an epoch; returns (result, optimiser, raw weights, recorder)."""
    optimizer = build_optimizer(model.parameters(), "adam", 1e-2)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    raw: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_post_hook(
        lambda *_: raw.append({k: v.clone() for k, v in model.named_parameters()})
    )
    result = fit(
        model,
        Objective(SoftAttentionLoss(1.0), optimizer),
        _batches(),
        None,
        FitOptions(max_epochs=epochs, patience=3, seed=7, ema_decay=0.8),
        (rec := Recorder(),),
        resume=ResumeState(epoch=start_epoch, average_state=average_state),
    )
    return result, optimizer, raw, rec


def test_moving_average_is_what_is_kept_and_the_trained_weights_travel_beside_it() -> None:
    model = _model()
    result, _, raw, rec = _fit_ema(model, 2)
    assert len(raw) == 8  # 4 batches x 2 epochs
    # the EMA by its definition: the first step's weights, then e <- 0.8 e + 0.2 w
    expected = dict(raw[0])
    for weights in raw[1:]:
        expected = {k: 0.8 * expected[k] + 0.2 * w for k, w in weights.items()}
    for name, value in expected.items():
        torch.testing.assert_close(result.best_state[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    saved = rec.saved[-1]
    for name, value in raw[-1].items():  # train_state: the optimiser's own weights
        torch.testing.assert_close(saved["train_state"][name], value)
    assert not torch.allclose(saved["model_state"]["out.weight"], raw[-1]["out.weight"])


def test_a_run_resumed_from_its_checkpoint_continues_the_average_and_the_weights() -> None:
    whole, _, _, _ = _fit_ema(_model(), 2)
    _, optimizer, _, rec = _fit_ema(_model(), 1)
    saved = rec.saved[-1]
    resumed = _model(seed=5)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(saved["train_state"])
    result, _, _, _ = _fit_ema(
        resumed,
        2,
        start_epoch=1,
        average_state=saved["model_state"],
        optimizer_state=optimizer.state_dict(),
    )
    for name, value in whole.best_state.items():
        torch.testing.assert_close(result.best_state[name], value, rtol=1e-5, atol=1e-6)
    # and restarting the average instead of continuing it ends elsewhere
    restarted = _model(seed=5)
    restarted.load_state_dict(saved["train_state"])
    other, _, _, _ = _fit_ema(restarted, 2, start_epoch=1, optimizer_state=optimizer.state_dict())
    assert not torch.allclose(other.best_state["out.weight"], whole.best_state["out.weight"])


def test_without_a_moving_average_the_checkpoint_has_no_train_state() -> None:
    rec = Recorder()
    _fit(_model(), callbacks=[rec])
    assert rec.saved[-1]["train_state"] is None
    with pytest.raises(ValueError, match="ema_decay"):
        FitOptions(max_epochs=1, patience=1, ema_decay=1.0)


def test_fit_options_refuse_a_patience_below_one_and_a_decay_of_one() -> None:
    with pytest.raises(ValueError, match="patience must be >= 1, got 0"):
        FitOptions(max_epochs=1, patience=0)
    with pytest.raises(ValueError, match="ema_decay must be in"):
        FitOptions(max_epochs=1, patience=1, ema_decay=1.0)
    FitOptions(max_epochs=1, patience=1, ema_decay=0.999)  # the bounds are [0, 1)


# ------------------------------------------------------------------ end to end (real model)
def write_tiny_run(root: Path) -> tuple[Path, Path]:
    """captions.parquet + vocab.json + {train,val}.arrow: colour words readable off feature 0."""
    import numpy as np

    from sat_model.data.vocab import save_vocab
    from sat_model.features.spec import EncoderSpec
    from sat_model.features.store import FeatureWriter

    prepared, features = root / "prepared", root / "features"
    colours = ["red", "blue", "green"]
    rows, vectors = [], {"train": ([], []), "val": ([], [])}
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 6)):
        for i in range(n):
            image_id, colour = f"{split}{i}", colours[i % 3]
            feats = rng.standard_normal((L, D)).astype(np.float16) * 0.1
            feats[:, i % 3] += 2.0  # the colour is in the features
            vectors[split][0].append(image_id)
            vectors[split][1].append(feats)
            for c, words in enumerate([["a", colour, "circle"], ["the", colour, "shape"]]):
                rows.append((image_id, split, c, " ".join(words), words))
    prepared.mkdir(parents=True)
    write_captions(prepared / "captions.parquet", [r[:4] for r in rows])
    save_vocab(
        build_vocab([r[4] for r in rows if r[1] == "train"], 1, 100, 20), prepared / "vocab.json"
    )
    spec = EncoderSpec("random", "none", 32, L, D, 2, 2, "0" * 64)
    for split, (ids, feats) in vectors.items():
        with FeatureWriter(features / f"{split}.arrow", spec) as writer:
            writer.write(ids, np.stack(feats))
    return prepared, features


TINY = [
    "model.embed_dim=8",
    "model.hidden_dim=16",
    "model.attention_dim=8",
    "model.dropout=0.0",
    "train.val_images=4",
    "train.val_max_length=6",
]


def _assert_flat_metrics_and_two_epochs_of_curves(model_dir: Path) -> dict[str, float]:
    """train_metrics.json is flat and names what a run reports; curves.csv has a row an epoch
    with scores in their ranges. Returns the metrics."""
    import csv
    import json

    metrics = json.loads((model_dir / "train_metrics.json").read_text())
    assert {
        "best_epoch",
        "epochs",
        "final_train_loss",
        "best_val_bleu_4",
        "final_val_bleu_4",
        "train_captions",
        "skipped_captions",
        "val_images",
    } <= set(metrics)
    assert metrics["epochs"] == 2 and metrics["train_captions"] == 48
    assert metrics["val_images"] == 4
    assert all(isinstance(v, int | float) for v in metrics.values())  # flat
    with (model_dir / "curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in curves] == [1, 2]
    assert set(curves[0]) == {"epoch", "train_loss", "val_bleu_4", "val_cider", "lr"}
    assert 0.0 <= float(curves[0]["val_bleu_4"]) <= 1.0
    assert 0.0 <= float(curves[0]["val_cider"]) <= 10.0  # CIDEr-D: 10 x a mean cosine
    assert metrics["final_val_cider"] == pytest.approx(float(curves[-1]["val_cider"]))
    return metrics


def _assert_the_model_loads_with_its_vocab_and_store_spec(
    model_dir: Path, prepared: Path, features: Path, attention: str, metrics: dict[str, float]
) -> None:
    """The model folder loads for inference with the run's vocabulary, records the feature
    store's encoder spec, and holds the best epoch's weights."""
    import json

    from sat_model.data.vocab import load_vocab
    from sat_model.features.spec import EncoderSpec
    from sat_model.features.store import FeatureStore
    from sat_model.model.checkpoint import load_model

    model, vocab, config = load_model(model_dir)
    assert config.attention == attention and config.annotation_dim == D
    assert not model.training
    assert vocab.itos == load_vocab(prepared / "vocab.json").itos
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["encoder"]["name"] == "random" and cfg["encoder"]["num_locations"] == L
    recorded = EncoderSpec.from_fields(cfg["encoder"])
    assert recorded == FeatureStore(features / "train.arrow").spec
    assert "format_version" not in cfg["encoder"]  # the store's, not the encoder's
    # the saved model is the best epoch's
    assert load_checkpoint(model_dir, training=True).training.epoch == metrics["best_epoch"]


@pytest.mark.java
@pytest.mark.slow
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_train_model_writes_a_loadable_model_metrics_and_curves(
    tmp_path: Path, attention: str
) -> None:
    import shutil

    from sat_model.params import load_params
    from sat_model.train.run import train_model

    if shutil.which("java") is None:
        pytest.skip("validation BLEU needs Java for the PTB tokenizer")
    prepared, features = write_tiny_run(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    params = load_params(
        tmp_path / "params.yaml",
        [
            *TINY,
            f"train.{attention}.max_epochs=2",
            f"train.{attention}.batch_size=8",
            f"train.{attention}.lr=0.01",
        ],
    )
    result = train_model(
        params, attention, TrainFolders(prepared, features, tmp_path / "models"), worker=CPU
    )
    model_dir = tmp_path / "models" / attention
    assert result.model_dir == model_dir
    assert {p.name for p in model_dir.iterdir()} == {
        "model.safetensors",
        "best_state.pt",
        "last_state.pt",
        "config.json",
        "vocab.json",
        "train_metrics.json",
        "curves.csv",
    }
    metrics = _assert_flat_metrics_and_two_epochs_of_curves(model_dir)
    _assert_the_model_loads_with_its_vocab_and_store_spec(
        model_dir, prepared, features, attention, metrics
    )


@pytest.mark.parametrize(("monitor", "shipped"), [("cider", 2), ("bleu_4", 1)])
def test_train_monitor_picks_the_shipped_epoch_by_its_validation_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, monitor: str, shipped: int
) -> None:
    """`train.monitor` (cider in the Flickr8k profile) decides which epoch is shipped. The val
    scores are set so that BLEU-4 peaks at epoch 1 and CIDEr at epoch 2."""
    import json

    from sat_model.params import load_params
    from sat_model.train import run, validation

    by_epoch = [(0.3, 0.1), (0.2, 0.5), (0.1, 0.2)]  # (BLEU-4, CIDEr) of epochs 1, 2, 3
    scores = iter([{"bleu_4": b, "cider": c} for b, c in by_epoch])
    monkeypatch.setattr(validation, "score_captions", lambda *a, **k: next(scores))
    prepared, features = write_tiny_run(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    overrides = [*TINY, f"train.monitor={monitor}", "train.soft.max_epochs=3"]
    params = load_params(tmp_path / "params.yaml", [*overrides, "train.soft.batch_size=8"])
    run.train_model(
        params, "soft", TrainFolders(prepared, features, tmp_path / "models"), worker=CPU
    )
    metrics = json.loads((tmp_path / "models" / "soft" / "train_metrics.json").read_text())
    assert metrics["best_epoch"] == shipped
    assert (metrics["best_val_bleu_4"], metrics["best_val_cider"]) == (
        (0.2, 0.5) if monitor == "cider" else (0.3, 0.1)
    )


def test_train_mirror_trains_on_the_mirrored_store_and_nothing_else_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train.mirror: 1` pairs every caption with its photo's mirrored features. A mirrored
    store that holds the train features again trains exactly as `train.mirror: 0` (no caption
    here says left or right); one that holds other features trains otherwise."""
    import json
    import shutil

    import numpy as np

    from sat_model.config import ParamsError
    from sat_model.features.store import FeatureStore, FeatureWriter
    from sat_model.params import load_params
    from sat_model.train import run, validation

    monkeypatch.setattr(validation, "score_captions", lambda *a, **k: {"bleu_4": 0.1, "cider": 0.2})
    prepared, features = write_tiny_run(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    overrides = [*TINY, "train.soft.max_epochs=2", "train.soft.batch_size=8"]

    def final_loss(mirror: float, name: str) -> float:
        params = load_params(
            tmp_path / "params.yaml",
            [*overrides, "encoder.mirror_train=true", f"train.mirror={mirror}"],
        )
        run.train_model(
            params, "soft", TrainFolders(prepared, features, tmp_path / name), worker=CPU
        )
        metrics = json.loads((tmp_path / name / "soft" / "train_metrics.json").read_text())
        return float(metrics["final_train_loss"])

    train = FeatureStore(features / "train.arrow")
    mirrored = features / "train_mirrored.arrow"
    shutil.copy(features / "train.arrow", mirrored)
    plain = final_loss(0.0, "plain")
    assert final_loss(1.0, "copy") == plain
    rows = np.arange(len(train))
    with FeatureWriter(mirrored, train.spec) as writer:  # each photo's features reversed
        writer.write(train.ids, train.get_batch(rows)[:, :, ::-1].copy())
    assert final_loss(1.0, "reversed") != plain
    with pytest.raises(ParamsError, match=r"encoder\.mirror_train is false"):
        load_params(tmp_path / "params.yaml", ["train.mirror=0.5"])


def _scst_overrides(max_epochs: int, scst_epochs: int) -> list[str]:
    return [
        *TINY,
        "train.monitor=cider",
        f"train.soft.max_epochs={max_epochs}",
        f"train.soft.patience={max_epochs + scst_epochs}",
        "train.soft.batch_size=8",
        f"train.soft.scst_epochs={scst_epochs}",
        "train.soft.scst_lr=0.001",
        "train.soft.scst_samples=3",
        "train.soft.scst_batch_size=8",
    ]


class _Killed(RuntimeError):
    pass


class _KillAfter(Callback):
    """Stops the run after ``epoch`` as a kill would: the model folder is already written."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, state: EpochState) -> None:
        if state.epoch == self.epoch:
            raise _Killed(f"killed after epoch {state.epoch}")


def _assert_two_self_critical_epochs_followed(whole: Path) -> tuple[dict[str, Any], Checkpoint]:
    """An uninterrupted run: four epochs, the third at `scst_lr`, a self-critical last state
    whose weights moved away from the shipped best likelihood epoch's. Returns that last state
    and the shipped checkpoint."""
    import csv
    import json

    from sat_model.train import run

    with (whole / "curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in curves] == [1, 2, 3, 4]
    assert [float(r["lr"]) for r in curves][2] == pytest.approx(0.001)  # scst_lr, cosine
    state = run.load_training_state(whole / LAST_STATE_FILE)
    assert state["phase"] == "self_critical" and state["epoch"] == 4
    assert json.loads((whole / "train_metrics.json").read_text())["epochs"] == 4
    # the self-critical epochs moved the weights away from the best likelihood epoch's (1)
    best = load_checkpoint(whole, training=True)
    assert best.training.epoch == 1
    moved = [not torch.equal(best.model_state[k], v) for k, v in state["model_state"].items()]
    assert sum(moved) > len(moved) // 2
    return state, best


def _assert_a_finished_likelihood_run_goes_on_into_them(
    train: Callable[..., Path], tmp_path: Path, state: dict[str, Any]
) -> None:
    """A likelihood run that had finished, and the same folder in format 1 (model.pt, as the
    code before safetensors wrote it), resume into the self-critical epochs and end as the
    uninterrupted run's ``state``."""
    from sat_model.train import run

    likelihood = train("likelihood", 0, worker=CPU)
    assert run.load_training_state(likelihood / LAST_STATE_FILE)["phase"] == "likelihood"
    # the same folder as the code before safetensors wrote it (format 1: model.pt) resumes alike
    legacy = to_format_1(Path(shutil.copytree(likelihood, tmp_path / "legacy" / "soft")))
    for folder, name in ((likelihood, "likelihood"), (legacy, "legacy")):
        train(name, 2, worker=CPU, resume_from=folder)
        resumed = run.load_training_state(folder / LAST_STATE_FILE)
        assert resumed["phase"] == "self_critical" and resumed["epoch"] == 4
        for key, value in state["model_state"].items():
            torch.testing.assert_close(resumed["model_state"][key], value, msg=key)


@pytest.mark.slow
def test_self_critical_epochs_follow_the_likelihood_ones_and_resume_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scst_epochs` adds self-critical epochs after `max_epochs`, from the best likelihood
    epoch, at `scst_lr`; a run killed in them resumes in them and ends where the uninterrupted
    run ends; a likelihood run that had finished goes on into them; a self-critical state is
    refused by a run without them; `scst_bleu_weight` reaches the reward."""
    from sat_model.params import load_params
    from sat_model.train import run, validation

    monkeypatch.setattr(validation, "score_captions", lambda *a, **k: {"bleu_4": 0.1, "cider": 0.2})
    prepared, features = write_tiny_run(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")

    def train(name: str, scst_epochs: int, extra: tuple[str, ...] = (), **kwargs: object) -> Path:
        overrides = [*_scst_overrides(2, scst_epochs), *extra]
        params = load_params(tmp_path / "params.yaml", overrides)
        run.train_model(params, "soft", TrainFolders(prepared, features, tmp_path / name), **kwargs)
        return tmp_path / name / "soft"

    whole = train("whole", 2, worker=CPU)
    state, best = _assert_two_self_critical_epochs_followed(whole)

    # BLEU-4 in the reward changes the self-critical gradient, not the likelihood epochs
    mixed = train("mixed", 2, ("train.soft.scst_bleu_weight=1.0",), worker=CPU)
    mixed_state = run.load_training_state(mixed / LAST_STATE_FILE)["model_state"]
    assert any(not torch.equal(mixed_state[k], v) for k, v in state["model_state"].items())
    assert load_checkpoint(mixed, training=True).training.epoch == 1
    for name, value in best.model_state.items():
        torch.testing.assert_close(load_checkpoint(mixed).model_state[name], value, msg=name)

    with pytest.raises(_Killed):
        train("killed", 2, worker=CPU, callbacks=[_KillAfter(3)])
    killed = tmp_path / "killed" / "soft"
    assert run.load_training_state(killed / LAST_STATE_FILE)["phase"] == "self_critical"
    train("killed", 2, worker=CPU, resume_from=killed)
    final = run.load_training_state(killed / LAST_STATE_FILE)["model_state"]
    for name, value in state["model_state"].items():
        torch.testing.assert_close(final[name], value, msg=name)

    _assert_a_finished_likelihood_run_goes_on_into_them(train, tmp_path, state)

    with pytest.raises(CheckpointError, match="self_critical phase"):
        train("whole", 0, worker=CPU, resume_from=whole)
