"""The ``register`` stage's work: log and register each evaluated model, then move ``champion``.

For each attention type with a model folder and a ``metrics.json``: the model is logged as a
pyfunc built from code INTO ITS TRAINING RUN (found by the checkpoint hash the train stage tags
it with), together with the test metrics, the evaluation params, ``captions.json``,
``metrics.json``, the attention gallery, ``curves.csv`` and the prepared data and features as
dataset inputs (DVC hashes); then it is registered under ``mlflow.model_name`` (reused when the
same checkpoint was registered before), so the version's run is the training run. A model with
no known training run (trained ``--in-process``) gets a run of its own,
``register-<attention>-<hash>``. ``champion`` moves to a new version only when it beats the
current champion on ``mlflow.champion_metric``, and only where ``mlflow.promote`` allows
(``auto``: not inside a ``dvc exp run``) and only to a version that reaches
``promotion.floor``. Each new version gets its model card
(:mod:`pipeline.tracking.governance.card`).
:func:`register_models` returns what happened (the content of ``reports/registry.json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.settings import Params
from pipeline.tracking.lineage import (
    dataset_inputs,
    dvc_experiment,
    find_training_run,
    lineage_tags,
)
from pipeline.tracking.packaging import RegisteredVersion, log_and_register
from pipeline.tracking.registry import (
    checkpoint_sha256,
    current_champion,
    promote_if_better,
    promotion_allowed,
)
from pipeline.tracking.runs import (
    ATTENTION_TAG,
    EXPERIMENT_TAG,
    Tracking,
    connect,
    flatten,
    with_retries,
)
from sat_model.config import ATTENTION_KINDS, EvalConfig
from sat_model.evaluation.reports import CAPTIONS_FILE, GALLERY_DIR, METRICS_FILE
from sat_model.model.checkpoint import (
    CONFIG_FILE,
    CURVES_FILE,
    TRAIN_METRICS_FILE,
    is_checkpoint_dir,
)

__all__ = ["register_models"]


def register_models(
    params: Params, project_root: Path, params_file: Path | None = None
) -> dict[str, Any]:
    """Register what was evaluated under ``project_root``; return the ``registry.json`` content.

    Raises:
        FileNotFoundError: no attention type has both a model and its metrics.
    """
    cfg = params.mlflow
    tracking = connect(cfg, project_root)
    lineage = lineage_tags(
        project_root,
        prepared_dir=params.data.prepared_dir,
        features_dir=params.encoder.features_dir,
    )
    experiment = dvc_experiment()
    if experiment is not None:
        lineage[EXPERIMENT_TAG] = experiment
    report: dict[str, Any] = {"model_name": cfg.model_name, "metric": cfg.champion_metric}
    report.update(versions=[], skipped=[], promotions=[], dvc_experiment=experiment)
    for attention in ATTENTION_KINDS:
        if not _evaluated(params, project_root, attention):
            report["skipped"].append({"item": attention, "reason": "no model or no metrics"})
            continue
        tags = {ATTENTION_TAG: attention, **lineage}
        registered, training_run, seconds = _register_one(
            params, project_root, tracking, attention, tags
        )
        if not registered.reused:
            where = params_file or project_root / "params.yaml"
            card = _CardOf(registered, attention, tags, seconds)
            _log_card(params, project_root, where, tracking, card)
        report["versions"].append(
            {"attention": attention, "training_run_id": training_run, **asdict(registered)}
        )
        allowed, why_not = promotion_allowed(cfg.promote, experiment, registered.version)
        report["promotions"].append(_promotion(params, tracking, registered, allowed, why_not))
    if not report["versions"]:
        raise FileNotFoundError(
            f"nothing to register: no model with metrics under {params.train.models_dir}/"
            f"{{soft,hard}} and {params.eval.reports_dir}/{{soft,hard}}/{METRICS_FILE}"
        )
    champion = tracking.call(lambda c: current_champion(c, cfg.model_name), "champion")
    report["champion"] = str(champion.version) if champion else None
    report["champion_attention"] = champion.tags.get(ATTENTION_TAG) if champion else None
    return report


def _evaluated(params: Params, root: Path, attention: str) -> bool:
    model_dir = root / params.train.models_dir / attention
    metrics_file = root / params.eval.reports_dir / attention / METRICS_FILE
    return is_checkpoint_dir(model_dir) and metrics_file.is_file()


def _run_artifacts(model_dir: Path, reports: Path) -> list[tuple[str, str | Path]]:
    """What the version's run shows beside the model (missing files are left out)."""
    return [
        ("evaluation", reports / METRICS_FILE),
        ("evaluation", reports / CAPTIONS_FILE),
        ("evaluation/attention", reports / GALLERY_DIR),
        ("training", model_dir / CURVES_FILE),
        ("training", model_dir / TRAIN_METRICS_FILE),
    ]


def _decoding(ev: EvalConfig, attention: str) -> dict[str, Any]:
    """The decoding the evaluate stage scored ``attention``'s model with, for the served model."""
    from sat_model.model.decoding import decode_mode

    return {
        "beam_size": ev.beam_size,
        "max_length": ev.max_length,
        "length_penalty": getattr(ev.length_penalty, attention),
        "mode": decode_mode(ev.hard_decode, attention),
    }


def _register_one(
    params: Params, root: Path, tracking: Tracking, attention: str, tags: dict[str, str]
) -> tuple[RegisteredVersion, str | None, float | None]:
    """Log one evaluated model into its training run (or a new run) and register it; returns
    the version, its training run and the training time."""
    cfg = params.mlflow
    model_dir = root / params.train.models_dir / attention
    reports = root / params.eval.reports_dir / attention
    config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    logged = {"model": config.get("model", {}), "train": config.get("train", {})}
    sha = checkpoint_sha256(model_dir)
    training_run = find_training_run(tracking, sha)
    client = tracking.client()
    # read before the model is logged into the run, which ends it anew
    seconds = _training_seconds(tracking, training_run) if training_run else None

    def register() -> RegisteredVersion:
        return log_and_register(
            client,
            model_dir=model_dir,
            model_name=cfg.model_name,
            experiment_id=tracking.experiment_id,
            metrics=json.loads((reports / METRICS_FILE).read_text(encoding="utf-8")),
            params=flatten({**logged, "eval": params.eval.model_dump()}),
            tags=tags,
            run_artifacts=_run_artifacts(model_dir, reports),
            run_name=f"register-{attention}-{sha[:8]}",
            run_id=training_run,
            decoding=_decoding(params.eval, attention),
        )

    registered = with_retries(register, retries=cfg.retries, what=f"register {attention}")
    inputs = dataset_inputs(
        root, prepared_dir=params.data.prepared_dir, features_dir=params.encoder.features_dir
    )
    if inputs and not registered.reused and registered.run_id:
        run_id = registered.run_id
        tracking.call(lambda c: c.log_inputs(run_id, inputs), "dataset inputs")
    return registered, training_run, seconds


def _promotion(
    params: Params, tracking: Tracking, registered: RegisteredVersion, allowed: bool, why: str
) -> dict[str, Any]:
    """Move ``champion`` to ``registered`` if it beats the champion and promotion is allowed."""
    if not allowed:
        return {"candidate": registered.version, "promoted": False, "reason": why}
    cfg, client = params.mlflow, tracking.client()
    outcome = with_retries(
        lambda: promote_if_better(
            client,
            cfg.model_name,
            registered.version,
            cfg.champion_metric,
            params.promotion.floor,
        ),
        retries=cfg.retries,
        what="promotion",
    )
    return asdict(outcome)


@dataclass(frozen=True)
class _CardOf:
    """The new version a card is written for, and what the registration knew of it."""

    registered: RegisteredVersion
    attention: str
    lineage: dict[str, str]
    training_seconds: float | None


def _training_seconds(tracking: Tracking, run_id: str) -> float | None:
    """From the training run's start to its last epoch's logged loss; None when unrecorded."""

    def read(client: Any) -> float | None:
        start = client.get_run(run_id).info.start_time
        epochs = client.get_metric_history(run_id, "train_loss")
        if not start or not epochs:
            return None
        return (max(m.timestamp for m in epochs) - start) / 1000.0

    return tracking.call(read, "training time")


def _log_card(
    params: Params,
    root: Path,
    params_file: Path,
    tracking: Tracking,
    card: _CardOf,
) -> None:
    """Write the version's model card into its run and tag the version with it."""
    from pipeline.tracking.governance.card import (
        CARD_PATH,
        CARD_SUMMARY_TAG,
        CARD_TAG,
        gather_card_facts,
        render_card,
        summary_line,
    )
    from pipeline.tracking.governance.seeds import seed_scores

    name, version = card.registered.model_name, card.registered.version
    facts = gather_card_facts(
        identity=(name, version, card.attention),
        params=params,
        root=root,
        params_file=params_file,
        lineage=card.lineage,
        training_seconds=card.training_seconds,
        seeds=tracking.call(lambda c: seed_scores(c, name, version), "seeds"),
    )
    run_id = card.registered.run_id

    def log(client: Any) -> None:
        if run_id:
            client.log_text(run_id, render_card(facts), CARD_PATH)
            client.set_model_version_tag(name, version, CARD_TAG, CARD_PATH)
        client.set_model_version_tag(name, version, CARD_SUMMARY_TAG, summary_line(facts))

    tracking.call(log, f"model card of version {version}")
