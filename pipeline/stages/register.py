"""DVC stage ``register``: log and register each evaluated model, then move ``champion``.

For each attention type with a model folder and a ``metrics.json``: the model is logged as a
pyfunc built from code INTO ITS TRAINING RUN (found by the checkpoint hash the train stage tags
it with), together with the test metrics, the evaluation params, ``captions.json``,
``metrics.json``, the attention gallery, ``curves.csv`` and the prepared data and features as
dataset inputs (DVC hashes); then it is registered under ``mlflow.model_name`` (reused when the
same checkpoint was registered before), so the version's run is the training run. A model with
no known training run (trained ``--in-process``) gets a run of its own,
``register-<attention>-<hash>``. ``champion`` moves to a new version only when it beats the
current champion on ``mlflow.champion_metric``, and only where ``mlflow.promote`` allows
(``auto``: not inside a ``dvc exp run``). ``reports/registry.json`` records what happened.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pipeline.stages import stage_parser

__all__ = ["main", "register_models"]

ATTENTIONS = ("soft", "hard")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = stage_parser(__name__, __doc__)
    parser.add_argument("--out", default=None, help="default: <eval.reports_dir>/registry.json")
    return parser.parse_args(argv)


def _run_artifacts(model_dir: Path, reports: Path) -> list[tuple[str, Path]]:
    """What the version's run shows beside the model (missing files are left out)."""
    return [
        ("evaluation", reports / "metrics.json"),
        ("evaluation", reports / "captions.json"),
        ("evaluation/attention", reports / "attention"),
        ("training", model_dir / "curves.csv"),
        ("training", model_dir / "train_metrics.json"),
    ]


def _register_one(params, project_root: Path, tracking, attention: str, tags: dict):
    """Log one evaluated model into its training run (or a new run) and register it."""
    from pipeline.registry import checkpoint_sha256, log_and_register
    from pipeline.tracking import dataset_inputs, find_training_run, flatten, with_retries

    cfg = params.mlflow
    model_dir = project_root / params.train.models_dir / attention
    reports = project_root / params.eval.reports_dir / attention
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    sha = checkpoint_sha256(model_dir)
    training_run = find_training_run(tracking, sha)
    client = tracking.client()

    def register():
        return log_and_register(
            client, model_dir=model_dir, model_name=cfg.model_name,
            experiment_id=tracking.experiment_id,
            metrics=json.loads((reports / "metrics.json").read_text(encoding="utf-8")),
            params=flatten({"model": config.get("model", {}), "train": config.get("train", {}),
                            "eval": params.eval.model_dump()}),
            tags=tags, run_artifacts=_run_artifacts(model_dir, reports),
            run_name=f"register-{attention}-{sha[:8]}", run_id=training_run,
        )  # fmt: skip

    registered = with_retries(register, retries=cfg.retries, what=f"register {attention}")
    inputs = dataset_inputs(
        project_root,
        prepared_dir=params.data.prepared_dir,
        features_dir=params.encoder.features_dir,
    )
    if inputs and not registered.reused and registered.run_id:
        tracking.call(lambda c: c.log_inputs(registered.run_id, inputs), "dataset inputs")
    return registered, training_run


def register_models(params, project_root: Path) -> dict:
    """Register what was evaluated; return the ``registry.json`` content."""
    from pipeline.registry import current_champion, promote_if_better, promotion_allowed
    from pipeline.tracking import (
        ATTENTION_TAG,
        EXPERIMENT_TAG,
        connect,
        dvc_experiment,
        lineage_tags,
        with_retries,
    )  # fmt: skip

    cfg = params.mlflow
    tracking = connect(cfg, project_root)
    client = tracking.client()
    lineage = lineage_tags(
        project_root,
        prepared_dir=params.data.prepared_dir,
        features_dir=params.encoder.features_dir,
    )
    experiment = dvc_experiment()
    if experiment is not None:
        lineage[EXPERIMENT_TAG] = experiment
    allowed, why_not = promotion_allowed(cfg.promote, experiment)
    report: dict = {"model_name": cfg.model_name, "metric": cfg.champion_metric, "versions": []}
    report.update(skipped=[], promotions=[], dvc_experiment=experiment)
    for attention in ATTENTIONS:
        model_dir = project_root / params.train.models_dir / attention
        metrics_file = project_root / params.eval.reports_dir / attention / "metrics.json"
        if not (model_dir / "model.pt").is_file() or not metrics_file.is_file():
            report["skipped"].append({"item": attention, "reason": "no model or no metrics"})
            continue
        tags = {ATTENTION_TAG: attention, **lineage}
        registered, training_run = _register_one(params, project_root, tracking, attention, tags)
        report["versions"].append(
            {"attention": attention, "training_run_id": training_run, **asdict(registered)}
        )
        if not allowed:
            report["promotions"].append({"candidate": registered.version, "promoted": False,
                                         "reason": why_not})  # fmt: skip
            continue
        outcome = with_retries(
            functools.partial(
                promote_if_better, client, cfg.model_name, registered.version, cfg.champion_metric
            ),
            retries=cfg.retries,
            what="promotion",
        )
        report["promotions"].append(asdict(outcome))
    if not report["versions"]:
        raise FileNotFoundError(
            f"nothing to register: no model with metrics under {params.train.models_dir}/"
            f"{{soft,hard}} and {params.eval.reports_dir}/{{soft,hard}}/metrics.json"
        )
    champion = tracking.call(lambda c: current_champion(c, cfg.model_name), "champion")
    report["champion"] = str(champion.version) if champion else None
    return report


def _fail(err: BaseException) -> int:
    """Print a tracking failure (retries spent) without the traceback, credentials redacted:
    DVC keeps stage output in logs, and the tracking URI may hold a token."""
    from pipeline.tracking import redact

    notes = "; ".join(getattr(err, "__notes__", []))
    print(f"register: error: {redact(str(err))} ({redact(notes)})", file=sys.stderr)
    print("register: local models and reports are unchanged; re-run when the server is up",
          file=sys.stderr)  # fmt: skip
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from sat_model.atomic import write_text_atomic
    from sat_model.config import load_params

    params = load_params(args.params, args.overrides)
    from mlflow.exceptions import MlflowException

    try:
        report = register_models(params, Path.cwd())
    except FileNotFoundError:
        raise  # nothing to register: a local problem, its message is already clear
    except (MlflowException, OSError) as e:  # the tracking store, after with_retries gave up
        return _fail(e)
    out = Path(args.out or Path(params.eval.reports_dir) / "registry.json")
    write_text_atomic(out, json.dumps(report, indent=1) + "\n")
    for p in report["promotions"]:
        verb = "promoted" if p["promoted"] else "not promoted"
        print(f"version {p['candidate']}: {verb} (champion {report['champion']}): {p['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
