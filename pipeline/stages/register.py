"""DVC stage ``register``: log and register each evaluated model, then move ``champion``.

For each attention type with a model folder and a ``metrics.json``: one MLflow run holding the
evaluation metrics, the params, the attention gallery, lineage tags, and the model as a pyfunc
built from code; one registered version under ``mlflow.model_name`` (reused when the same
checkpoint was registered before). ``champion`` moves to a new version only when it beats the
current champion on ``mlflow.champion_metric``. ``reports/registry.json`` records what happened.
"""

from __future__ import annotations

import argparse
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


def register_models(params, project_root: Path) -> dict:  # type: ignore[no-untyped-def]
    """Register what was evaluated; return the ``registry.json`` content."""
    from pipeline.registry import log_and_register, promote_if_better
    from pipeline.tracking import connect, flatten, lineage_tags, with_retries

    cfg = params.mlflow
    tracking = connect(cfg, project_root)
    client = tracking.client()
    lineage = lineage_tags(
        project_root,
        prepared_dir=params.data.prepared_dir,
        features_dir=params.encoder.features_dir,
    )
    report: dict = {"model_name": cfg.model_name, "metric": cfg.champion_metric, "versions": []}
    report["skipped"], report["promotions"] = [], []
    for attention in ATTENTIONS:
        model_dir = project_root / params.train.models_dir / attention
        metrics_file = project_root / params.eval.reports_dir / attention / "metrics.json"
        if not (model_dir / "model.pt").is_file() or not metrics_file.is_file():
            report["skipped"].append({"item": attention, "reason": "no model or no metrics"})
            continue
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        registered = with_retries(
            lambda md=model_dir, mf=metrics_file, c=config, a=attention: log_and_register(
                client, model_dir=md, model_name=cfg.model_name,
                experiment_id=tracking.experiment_id, metrics=json.loads(mf.read_text()),
                params=flatten({"model": c.get("model", {}), "train": c.get("train", {}),
                                "eval": params.eval.model_dump()}),
                tags={"attention": a, **lineage},
                run_artifacts={"attention": mf.parent / "attention"},
                run_name=f"register-{a}",
            ),
            retries=cfg.retries, what=f"register {attention}",
        )  # fmt: skip
        report["versions"].append({"attention": attention, **asdict(registered)})
        outcome = with_retries(
            lambda v=registered.version: promote_if_better(
                client, cfg.model_name, v, cfg.champion_metric
            ),
            retries=cfg.retries,
            what="promotion",
        )
        report["promotions"].append(asdict(outcome))
        report["champion"] = outcome.champion
    if not report["versions"]:
        raise FileNotFoundError(
            f"nothing to register: no model with metrics under {params.train.models_dir}/"
            f"{{soft,hard}} and {params.eval.reports_dir}/{{soft,hard}}/metrics.json"
        )
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
        verb = "promoted" if p["promoted"] else "kept"
        print(f"version {p['candidate']}: {verb} (champion {p['champion']}): {p['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
