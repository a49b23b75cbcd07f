"""Ray Train driver: DDP over sharded length-grouped batches, restarts, once-per-epoch logging.

The train function here is a tiny least-squares model stepped over the real
``LengthGroupedBatchSampler`` shards, so that the single-process reference is exact to compute:
with equal shard sizes and per-rank mean losses, DDP's averaged gradient equals the gradient of
the mean loss over the concatenated global batch. The ``train_with_ray`` tests run the real
training loop (``sat_train_fn``) on the tiny project: a worker killed after the best epoch, an
unfinished run resumed only when asked, a finished one not trained again.
"""

from __future__ import annotations

import csv
import functools
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from ray import cloudpickle

from pipeline.ray.attempts import attempts, choose_run, write_record
from pipeline.ray.fit import ScalingSpec, WorkerRun, deterministic_run_name, fit_on_ray
from pipeline.ray.storage import resolve_storage
from pipeline.ray.train import WorkerHooks, copy_checkpoint, train_with_ray
from pipeline.settings import MlflowConfig, Params, load_params
from pipeline.tracking.runs import Tracking, connect
from sat_model.train.batching import LengthGroupedBatchSampler
from sat_model.train.run import TrainFolders, TrainResult, load_training_state, train_model

# Ray workers cannot import this test module by name: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, FEATURES, BATCH = 32, 4, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=g)  # (N, F)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(N, generator=g)  # (N,)
    return x, y


def _fresh_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: list[int]) -> float:
    x, y = _data()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[idx]).squeeze(-1), y[idx])  # mean over the batch
    loss.backward()
    opt.step()
    return float(loss)


def linear_train_fn(run: WorkerRun) -> None:
    """Epochs 1..max_epochs of SGD on this rank's shard; rank 0 checkpoints and logs each epoch."""
    cfg = run.config
    model = _fresh_model()
    start = 1
    if run.resume_dir is not None:
        saved = torch.load(run.resume_dir / "state.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        start = int(saved["epoch"]) + 1
    if run.rank == 0:
        with open(cfg["starts_file"], "a") as f:
            f.write(f"{start}\n")
    model = run.wrap_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = LengthGroupedBatchSampler(
        [5] * N, BATCH, seed=3, num_replicas=run.world_size, rank=run.rank
    )
    logger = None
    if run.rank == 0 and cfg.get("tracked"):
        logger = cfg["tracked"].epochs()
    for epoch in range(start, cfg["max_epochs"] + 1):
        if epoch == cfg.get("die_at_epoch") and run.rank == run.world_size - 1:
            marker = Path(cfg["marker"])
            if not marker.exists():
                marker.write_text("died once")
                # Die mid-epoch, not at its first instruction: Ray Train's controller collects
                # reports on its health check (every 2 s), and a group that dies before the
                # epoch-1 report is collected resumes from the checkpoint before it.
                time.sleep(5.0)
                os._exit(1)  # a worker crash mid-run: Ray restarts the group
        losses = [_step(model, opt, idx) for idx in sampler.batches(epoch)]
        metrics = {"epoch": epoch, "loss": sum(losses) / len(losses)}
        if logger is not None:
            logger.log_epoch(epoch, {"loss": metrics["loss"]})
        out = Path(cfg["scratch"]) / f"rank{run.rank}-epoch{epoch}"
        out.mkdir(parents=True, exist_ok=True)
        inner = getattr(model, "module", model)
        torch.save({"model": inner.state_dict(), "epoch": epoch}, out / "state.pt")
        run.report(metrics, out)


def _reference(world_size: int, epochs: int) -> dict[str, torch.Tensor]:
    """One process stepping, epoch after epoch, over global batch i = the concatenation of every
    rank's batch i."""
    model = _fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(1, epochs + 1):
        shards = [
            LengthGroupedBatchSampler(
                [5] * N, BATCH, seed=3, num_replicas=world_size, rank=r
            ).batches(epoch)
            for r in range(world_size)
        ]
        for step in zip(*shards, strict=True):
            _step(model, opt, [i for batch in step for i in batch])
    return model.state_dict()


def _config(tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "max_epochs": 1,
        "scratch": str(tmp_path / "scratch"),
        "starts_file": str(tmp_path / "starts.txt"),
        **extra,
    }


@pytest.fixture
def tracking(tmp_path: Path) -> Tracking:
    return connect(MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"), tmp_path)


@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.slow
def test_two_ddp_workers_killed_in_epoch_2_end_where_one_process_does_on_the_global_batches(
    ray_local: object, tmp_path: Path, tracking: Tracking
) -> None:
    """One fit proves both: DDP over the shards equals one process over the global batches, and a
    worker that dies in epoch 2 restarts the group from epoch 1's checkpoint, each epoch logged
    once."""
    tracked = tracking.start_run("killed")
    config = _config(
        tmp_path,
        max_epochs=3,
        die_at_epoch=2,
        marker=str(tmp_path / "died"),
        tracked=tracked,
    )
    outcome = fit_on_ray(
        linear_train_fn,
        config=config,
        run_name="killed",
        storage_path=tmp_path / "ray_results",
        scaling=ScalingSpec(num_workers=2, cpus_per_worker=1, use_gpu=False),
        max_failures=1,
    )
    assert (tmp_path / "died").exists()  # the crash did happen
    # first attempt started at epoch 1; the restart at epoch 2, from the epoch-1 checkpoint
    assert (tmp_path / "starts.txt").read_text().split() == ["1", "2"]
    assert outcome.metrics["epoch"] == 3
    final = torch.load(outcome.checkpoint_dir / "state.pt", weights_only=True)
    assert final["epoch"] == 3
    want = _reference(world_size=2, epochs=3)
    for key in want:
        torch.testing.assert_close(final["model"][key], want[key], rtol=1e-5, atol=1e-6)
    # and the comparison can fail: one process over one rank's shard alone ends elsewhere
    alone = _fresh_model()
    opt = torch.optim.SGD(alone.parameters(), lr=0.05)
    for epoch in (1, 2, 3):
        for idx in LengthGroupedBatchSampler([5] * N, BATCH, seed=3, num_replicas=2).batches(epoch):
            _step(alone, opt, idx)
    assert not torch.allclose(alone.weight, want["weight"], atol=1e-4)
    history = tracking.client().get_metric_history(tracked.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3]


def test_run_name_is_deterministic_and_changes_with_its_inputs() -> None:
    a = deterministic_run_name("sat-soft", {"lr": 1e-3}, {"features": "abc"})
    assert a == deterministic_run_name("sat-soft", {"lr": 1e-3}, {"features": "abc"})
    assert a != deterministic_run_name("sat-soft", {"lr": 2e-3}, {"features": "abc"})
    assert a.startswith("sat-soft-") and len(a) == len("sat-soft-") + 12


def test_copy_checkpoint_replaces_the_destination_whole(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"new")
    dst = tmp_path / "models" / "soft"
    dst.mkdir(parents=True)
    (dst / "model.safetensors").write_bytes(b"old")
    (dst / "config.json").write_text('{"format_version": 2, "model": {}}')  # a sat checkpoint
    (dst / "stale.json").write_text("{}")
    copy_checkpoint(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    assert (dst / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["soft"]  # no staging left behind


def test_storage_path_must_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        fit_on_ray(
            linear_train_fn,
            config={},
            run_name="x",
            storage_path=Path("relative/ray_results"),
            scaling=ScalingSpec(1, 1, False),
            max_failures=0,
        )


@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.java
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_train_with_ray_writes_the_model_folder_and_logs_each_epoch(
    ray_local: object, tiny_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two likelihood epochs, then one self-critical epoch (the Flickr8k profile's phases)
    scst = ["train.soft.scst_epochs=1", "train.soft.scst_samples=2", "train.soft.scst_batch_size=8"]
    params = load_params(tiny_project / "params.yaml", scst)
    outcome = train_with_ray(params, "soft", project_root=tiny_project)
    # the driver printed lines within each epoch, and one line per epoch, the last with nothing
    # left to run
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train ")]
    within = [line for line in printed if "  batch " in line]
    lines = [line for line in printed if line not in within]
    assert within and all(re.match(r"train soft  epoch \d/3  batch \d+/\d+  ", w) for w in within)
    number = r"-?\d+\.\d+"
    pattern = (
        rf"train soft  epoch (\d)/3  loss {number}  val BLEU-4 {number}  CIDEr {number}"
        rf"  \d+ captions/s  ETA (.+)"
    )
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches), lines
    assert [m[1] for m in matches if m] == ["1", "2", "3"]
    # the self-critical epoch is counted, not timed, until one has run (pipeline.ray.progress)
    etas = [m[2] for m in matches if m]
    assert re.fullmatch(r"\S+ \+ 1 self-critical epoch", etas[0]), etas
    assert etas[1:] == ["1 self-critical epoch", "0s"], etas
    model_dir = tiny_project / "models" / "soft"
    assert outcome.model_dir == model_dir
    files = ("model.safetensors", "config.json", "vocab.json", "train_metrics.json", "curves.csv")
    for name in (*files, "best_state.pt", "last_state.pt"):
        assert (model_dir / name).is_file(), name
    assert outcome.metrics["epochs"] == 3
    assert load_training_state(model_dir / "last_state.pt")["phase"] == "self_critical"
    assert re.fullmatch(r"sat-soft-[0-9a-f]{12}-1", outcome.run_name)
    tracking = connect(params.mlflow, tiny_project)
    run = tracking.client().get_run(outcome.mlflow_run_id)
    assert run.info.run_name == outcome.run_name
    assert run.info.status == "FINISHED"
    assert run.data.tags["sat.attention"] == "soft"
    assert run.data.params["train.soft.max_epochs"] == "2"
    for key in ("train_loss", "val_bleu_4", "val_cider", "lr"):  # the per-epoch set
        steps = [m.step for m in tracking.client().get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [1, 2, 3], key
    # the same identity (params, code, data, versions): a re-run trains nothing
    again = train_with_ray(params, "soft", project_root=tiny_project)
    assert (again.run_name, again.mlflow_run_id) == (outcome.run_name, outcome.mlflow_run_id)
    steps = tracking.client().get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in steps) == [1, 2, 3]


# ------------------------------------- the real training loop, failed mid-epoch, resumed when asked
FAIL_OVERRIDES = ["train.soft.max_epochs=4", "train.soft.lr=0.03", "train.soft.patience=10"]


def _record_epoch_start(starts_file: Path, run: WorkerRun, epoch: int) -> None:
    with open(starts_file, "a") as f:
        f.write(f"{epoch + 1}\n")


def _fail_mid_epoch(
    marker: Path, fail_at: tuple[int, int], run: WorkerRun, epoch: int, step: int
) -> None:
    """Raise in this worker once, at (epoch, step) of ``fail_at`` (0-based epoch)."""
    if (epoch, step) == fail_at and not marker.exists():
        marker.write_text(f"failed at epoch {epoch + 1} step {step}")
        # Ray Train's controller collects reports on its health check (every 2 s): wait so the
        # previous epoch's checkpoint is the run's latest before the worker fails
        time.sleep(5.0)
        raise RuntimeError(f"injected failure in epoch {epoch + 1}")


def _project_copy(tiny_project: Path, root: Path) -> Path:
    shutil.copytree(tiny_project / "data", root / "data")
    shutil.copy(tiny_project / "params.yaml", root / "params.yaml")
    return root


def _states(model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    best = safetensors.torch.load_file(model_dir / "model.safetensors")
    last = torch.load(model_dir / "last_state.pt", weights_only=True)
    return {"best": best, "last": last["model_state"]}


def _train_in_process(params: Params, project: Path, tmp_path: Path) -> TrainResult:
    """The run one Ray worker of one CPU makes (one intra-op thread), made in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_model(
            params,
            "soft",
            TrainFolders(
                project / params.data.prepared_dir,
                project / params.encoder.features_dir,
                tmp_path / "reference",
            ),
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.ray
@pytest.mark.mlflow
@pytest.mark.java
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="validation BLEU needs Java")
def test_real_training_failed_after_its_best_epoch_resumes_when_asked_as_if_never_stopped(
    ray_local: object, tiny_project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that fails mid-epoch after its best epoch (no retry by Ray) is resumed by the next
    invocation with ``resume=True``: from its last finished epoch, not the best one, under the
    same run, and the restored training state (weights, optimiser, scheduler, RNG) ends where an
    uninterrupted run ends. Ray's own restart of a failed worker group resumes through the same
    checkpoint hand-over (the DDP test above; the real loop on two nodes: test_ray_multinode)."""
    reference = _train_in_process(
        load_params(tiny_project / "params.yaml", FAIL_OVERRIDES), tiny_project, tmp_path
    )
    assert reference.metrics["epochs"] == 4
    # the failure below comes after epoch 3 finished: it must be later than the best epoch
    assert reference.metrics["best_epoch"] < 3, reference.metrics

    root = _project_copy(tiny_project, tmp_path / "project")
    params = load_params(root / "params.yaml", [*FAIL_OVERRIDES, "ray.max_failures=0"])
    starts, marker = tmp_path / "starts.txt", tmp_path / "failed.txt"
    hooks = WorkerHooks(
        on_epoch_start=functools.partial(_record_epoch_start, starts),
        # epoch 4, step 3 of 8
        on_step=functools.partial(_fail_mid_epoch, marker, (3, 3)),
        log_every=1,  # on_log (the step hook) every step
    )
    with pytest.raises(Exception, match="injected failure in epoch 4"):
        train_with_ray(params, "soft", project_root=root, hooks=hooks)
    (first,) = re.findall(r"training from epoch 1 as run (sat-soft-\w+-1)", capsys.readouterr().err)
    outcome = train_with_ray(params, "soft", project_root=root, resume=True, hooks=hooks)
    assert f"train@soft: resuming run {first} from its last epoch" in capsys.readouterr().err
    assert outcome.run_name == first
    # resumed at epoch 4 (the last finished epoch was 3), not at the best epoch
    assert starts.read_text().split() == ["1", "2", "3", "4", "4"]
    client = connect(params.mlflow, root).client()
    for key in ("train_loss", "val_bleu_4", "lr"):
        steps = [m.step for m in client.get_metric_history(outcome.mlflow_run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4], key  # each epoch logged once
    assert client.get_run(outcome.mlflow_run_id).info.status == "FINISHED"
    with (outcome.model_dir / "curves.csv").open() as f:
        assert [int(row["epoch"]) for row in csv.DictReader(f)] == [1, 2, 3, 4]
    assert outcome.metrics == reference.metrics
    got, want = _states(outcome.model_dir), _states(reference.model_dir)
    for which in ("best", "last"):
        for key, tensor in want[which].items():
            assert torch.equal(got[which][key], tensor), (which, key)


def test_each_invocation_of_an_unfinished_identity_is_a_new_attempt_unless_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """How the driver names runs from the records in Ray's storage (no Ray needed)."""
    storage, base = resolve_storage(str(tmp_path / "ray_results"), tmp_path), "sat-soft-abc"

    def choose(resume: bool = False) -> tuple[str, object]:
        return choose_run(attempts(storage, base), base, "soft", resume)

    assert choose() == (f"{base}-1", None)
    write_record(storage, f"{base}-1", {"status": "RUNNING"})  # it failed in epoch 2
    assert choose() == (f"{base}-2", None)  # the next invocation starts over, at epoch 1
    write_record(storage, f"{base}-2", {"status": "RUNNING"})
    assert choose(resume=True) == (f"{base}-2", None)  # --resume continues the latest
    said = capsys.readouterr().err
    assert "training from epoch 1 as run sat-soft-abc-1 (no earlier run of this identity)" in said
    assert f"run {base}-1 of this identity did not finish; --resume continues it" in said
    assert f"train@soft: resuming run {base}-2 from its last epoch" in said
    checkpoint = storage.child(f"{base}-2", "checkpoint_000001")
    checkpoint.child("model.safetensors").write_text("weights")
    write_record(storage, f"{base}-2", {"status": "FINISHED", "checkpoint": "checkpoint_000001"})
    name, done = choose(resume=True)  # a finished attempt is reused, resume or not
    assert name == f"{base}-2" and done is not None and done.checkpoint == checkpoint


@pytest.mark.parametrize("mirrored", [False, True])
def test_uploaded_worker_inputs_carry_the_mirrored_store_when_training_mirrors(
    tmp_path: Path, mirrored: bool
) -> None:
    """With `ray.worker_inputs: upload` the workers read only what is staged: a run with
    `train.mirror` > 0 needs `train_mirrored.arrow` among its inputs, and a run without it
    should not ship a second train store."""
    from pipeline.ray.storage import fetch_inputs, resolve_storage
    from pipeline.ray.train import stage_worker_inputs

    prepared, features = tmp_path / "prepared", tmp_path / "features"
    for folder, names in (
        (prepared, ["captions.parquet", "vocab.json"]),
        (features, ["train.arrow", "val.arrow", "train_mirrored.arrow"]),
    ):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(name)  # distinct contents: distinct blobs
    storage = resolve_storage(str(tmp_path / "store"), tmp_path)
    staged = stage_worker_inputs(storage, False, prepared, features, mirrored=mirrored)
    assert staged is not None
    fetched = fetch_inputs(staged.manifest, storage, tmp_path / "worker")
    names = sorted(p.name for p in (fetched / "features").iterdir())
    assert names == sorted(["train.arrow", "val.arrow"] + ["train_mirrored.arrow"] * mirrored)
    if mirrored:
        assert (fetched / "features" / "train_mirrored.arrow").read_text() == "train_mirrored.arrow"
