"""The model card of a registered version: Markdown generated from the project's records.

Everything on the card is read from what the pipeline wrote, never typed in: the data from
``prepare_report.json`` and ``dvc.lock`` (through the version's lineage tags), the params from
the checkpoint's ``config.json`` and the eval section, the scores from
``reports/<attention>/metrics.json`` and ``captions.json`` (so the card says what ``reports/``
says), the training from ``train_metrics.json`` and the training run, the intended use from the
data source. The register stage logs it into the version's run as :data:`CARD_PATH` and tags the
version with that path and a one-line summary; ``sat card`` prints it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from pipeline.tracking.governance.floor import FLOOR_MISSED_TAG, FLOOR_OVERRIDE_TAG
from pipeline.tracking.registry import RegistryError, version_of
from pipeline.tracking.runs import GIT_COMMIT_TAG, flatten
from sat_model.data.tables import REPORT_FILE as PREPARE_REPORT_FILE
from sat_model.evaluation.reports import CAPTIONS_FILE, METRICS_FILE
from sat_model.model.checkpoint import CONFIG_FILE, TRAIN_METRICS_FILE, recorded_data_source

__all__ = [
    "CARD_PATH",
    "CARD_SUMMARY_TAG",
    "CARD_TAG",
    "CardFacts",
    "card_text",
    "gather_card_facts",
    "render_card",
    "spread_line",
    "summary_line",
]

CARD_PATH = "card/model_card.md"  # in the version's run
CARD_TAG = "sat.card"  # on the version: the card's artifact path in its run
CARD_SUMMARY_TAG = "sat.card.summary"  # on the version: the card's first line of facts

# what the data allows a model trained on it to be used for, by data source (or dataset file)
USE_BY_SOURCE = {
    "synthetic": "captions the generated scenes of coloured shapes this project draws; it does "
    "not describe photos (a photo gets a caption of shapes). For trying the pipeline, teaching "
    "and tests. The scenes are generated here: no third-party data or licence.",
    "flickr8k": "for research use only: the Flickr8k photos are distributed for research and "
    "keep their Flickr owners' rights (the dataset's terms), so a model trained on them is "
    "for research, not for a product.",
    "flickr30k": "for research use only: the Flickr30k photos are distributed for "
    "non-commercial research and keep their Flickr owners' rights (the dataset's terms).",
    "coco": "COCO's captions are CC BY 4.0 and its photos keep their Flickr licences (COCO's "
    "terms of use): check them before any use beyond research.",
    "folder": "trained on your own photos and captions: their licence, and so this model's "
    "intended use, is yours to state.",
}
LIMITS = (
    "It writes English captions from its training vocabulary only; a photo unlike its "
    "training data still gets a confident caption, so check before trusting one. Its scores "
    "hold for the split named above of this dataset, not for other photos. Not for decisions "
    "about people."
)


@dataclass(frozen=True)
class CardFacts:
    """What a card says, each from one record (this module's docstring)."""

    model_name: str
    version: str
    attention: str
    params_file: str  # params.yaml, or profiles/<name>/params.yaml
    source: str
    split_sizes: Mapping[str, int]  # images per split, kept captions
    lineage: Mapping[str, str]  # git commit and the dvc.lock hashes of data and features
    params: Mapping[str, Any]  # flat: encoder, model, train of the checkpoint
    metrics: Mapping[str, float]
    scoring: Mapping[str, Any]  # split, images scored, beam, length penalty, decoding
    training: Mapping[str, Any]  # epochs, best epoch, captions, workers, seconds
    seeds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # seed -> metrics


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _params_label(params_file: Path) -> str:
    """``params.yaml``, or ``profiles/<name>/params.yaml`` for a dataset profile's run (whose
    project root is its own folder)."""
    from pipeline.stages.profiles import PROFILES_DIR

    folder = params_file.parent
    if folder.parent.name == PROFILES_DIR:
        return f"{PROFILES_DIR}/{folder.name}/{params_file.name}"
    return params_file.name


def _source_key(source: str, config: Mapping[str, Any]) -> str:
    """The key of :data:`USE_BY_SOURCE`: a Karpathy split file names its dataset."""
    if source != "karpathy":
        return source
    name = str(config.get("json_file", ""))
    return next((k for k in ("flickr30k", "coco") if k in name), "flickr8k")


def gather_card_facts(
    *,
    identity: tuple[str, str, str],
    params: Any,
    root: Path,
    params_file: Path,
    lineage: Mapping[str, str],
    training_seconds: float | None = None,
    seeds: Mapping[str, Mapping[str, float]] | None = None,
) -> CardFacts:
    """Read the records of ``identity`` (model name, version, attention) under ``root``."""
    model_name, version, attention = identity
    model_dir = root / params.train.models_dir / attention
    reports = root / params.eval.reports_dir / attention
    config = _json(model_dir / CONFIG_FILE)
    prepared = _json(root / params.data.prepared_dir / PREPARE_REPORT_FILE)
    captions = _json(reports / CAPTIONS_FILE)
    trained = _json(model_dir / TRAIN_METRICS_FILE)
    source = recorded_data_source(config) or params.data.source
    karpathy = params.data.karpathy.model_dump()
    ev = params.eval
    return CardFacts(
        model_name=model_name,
        version=version,
        attention=attention,
        params_file=_params_label(params_file),
        source=_source_key(source, karpathy) if source else "unrecorded",
        split_sizes={
            k: prepared[k]
            for k in ("images_train", "images_val", "images_test", "captions_kept")
            if k in prepared
        },
        lineage=dict(lineage),
        params=flatten({k: config[k] for k in ("encoder", "model", "train") if k in config}),
        metrics=_json(reports / METRICS_FILE),
        scoring={
            "split": captions.get("split", ev.split),
            "images": captions.get("images"),
            "beam_size": ev.beam_size,
            "length_penalty": getattr(ev.length_penalty, attention),
            "hard_decode": ev.hard_decode if attention == "hard" else None,
        },
        training={
            **{k: trained[k] for k in ("epochs", "best_epoch", "train_captions") if k in trained},
            "workers": trained.get("world_size"),
            "device": config.get("hardware", {}).get("device"),
            "seconds": training_seconds,
        },
        seeds=dict(seeds or {}),
    )


def summary_line(facts: CardFacts) -> str:
    """The card's facts in one line: the version tag :data:`CARD_SUMMARY_TAG`."""
    shown = [k for k in ("bleu_4", "cider") if k in facts.metrics]
    scores = ", ".join(f"{k} {facts.metrics[k]:.4f}" for k in shown)
    return (
        f"{facts.attention} attention on {facts.source}; {facts.scoring['split']} {scores} "
        f"(beam {facts.scoring['beam_size']}, seed {facts.params.get('train.seed', '?')})"
    )


def spread_line(seeds: Mapping[str, Mapping[str, float]], metric: str) -> str:
    """``bleu_4 over 3 seeds (0, 1, 2): mean 0.9012, sd 0.0031, 0.8977-0.9040``; "" with
    fewer than two seeds."""
    values = [m[metric] for m in seeds.values() if metric in m]
    if len(values) < 2:
        return ""
    return (
        f"{metric} over {len(values)} seeds ({', '.join(sorted(seeds))}): mean "
        f"{statistics.mean(values):.4f}, sd {statistics.stdev(values):.4f}, "
        f"{min(values):.4f}-{max(values):.4f}"
    )


def _table(rows: list[tuple[str, str]], head: tuple[str, str]) -> list[str]:
    return [f"| {head[0]} | {head[1]} |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _data(f: CardFacts) -> list[str]:
    hashes = [
        (k, f"`{f.lineage[t]}`")
        for k, t in (
            ("prepared data (dvc.lock md5)", "sat.prepared_md5"),
            ("features (dvc.lock md5)", "sat.features_md5"),
            ("git commit", GIT_COMMIT_TAG),
        )
        if t in f.lineage
    ]
    rows = [("source", f.source), ("params file", f"`{f.params_file}`")]
    rows += [(k.replace("_", " "), str(v)) for k, v in f.split_sizes.items()]
    return ["## Data", "", *_table(rows + hashes, ("record", "value")), ""]


def _scores(f: CardFacts) -> list[str]:
    s = f.scoring
    how = (
        f"Scored on the {s['split']} split ({s['images']} images) with pycocoevalcap's "
        f"scorers (PTB tokenizer; BLEU, METEOR, ROUGE-L, CIDEr), beam {s['beam_size']}, "
        f"length penalty {s['length_penalty']}"
        + (f", hard attention decoded `{s['hard_decode']}`" if s["hard_decode"] else "")
        + f", seed {f.params.get('train.seed', 'unrecorded')}."
    )
    rows = [(k, f"{v:.4f}") for k, v in f.metrics.items()]
    spread = [line for k in f.metrics if (line := spread_line(f.seeds, k))]
    seeds = [f"- {line}" for line in spread] or ["- one seed ran (no spread to show)"]
    return ["## Scores", "", how, "", *_table(rows, ("metric", "score")), "", *seeds, ""]


def _training(f: CardFacts) -> list[str]:
    t = f.training
    seconds = t.get("seconds")
    rows = [
        (k.replace("_", " "), str(v))
        for k, v in t.items()
        if k not in ("seconds", "workers", "device")
    ]
    rows.append(("training time", f"{seconds / 60:.1f} min" if seconds else "unrecorded"))
    workers = f"{t['workers']} worker(s)" if t.get("workers") else "workers unrecorded"
    device = f"each on {t['device']}" if t.get("device") else "the device is not recorded"
    rows.append(("hardware", f"{workers}; {device}"))
    return ["## Training", "", *_table(rows, ("record", "value")), ""]


def render_card(f: CardFacts) -> str:
    """The card as Markdown."""
    keep = ("encoder.name", "encoder.layer", "encoder.resize", "model.", "train.")
    params = [(f"`{k}`", f"{v}") for k, v in f.params.items() if k.startswith(keep)]
    use = USE_BY_SOURCE.get(f.source, "the data source is not recorded: state its licence.")
    lines = [
        f"# {f.model_name} version {f.version}: model card",
        "",
        f"Generated by the register stage from the project's records. {summary_line(f)}.",
        "",
        *_data(f),
        *_scores(f),
        *_training(f),
        "## Parameters",
        "",
        *_table(params, ("param", "value")),
        "",
        "## Intended use and limits",
        "",
        f"This model {use}",
        "",
        LIMITS,
        "",
    ]
    return "\n".join(lines)


def card_text(
    client: MlflowClient, model_name: str, version: str | None = None, alias: str = "champion"
) -> str:
    """The card of ``version`` (else of the version ``alias`` names) as logged, then what the
    registry says of that version now (aliases, a floor override)."""
    import tempfile

    chosen = version_of(client, model_name, version, alias)
    path = chosen.tags.get(CARD_TAG)
    if not path or not chosen.run_id:
        raise RegistryError(
            f"{model_name} version {chosen.version} has no model card: it was registered "
            "before cards were generated (the register stage writes one for each new version)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(client.download_artifacts(chosen.run_id, path, tmp)).read_text("utf-8")
    return f"{text.rstrip()}\n\n" + "\n".join(_registry_notes(client, model_name, chosen)) + "\n"


def _registry_notes(client: MlflowClient, model_name: str, version: ModelVersion) -> list[str]:
    number = str(version.version)
    held = client.get_registered_model(model_name).aliases.items()
    aliases = sorted(a for a, v in held if str(v) == number)
    lines = ["## In the registry now", "", f"- aliases: {', '.join(aliases) or 'none'}"]
    if FLOOR_OVERRIDE_TAG in version.tags:
        lines.append(
            f"- promoted below the promotion floor ({version.tags.get(FLOOR_MISSED_TAG, '')}): "
            f"{version.tags[FLOOR_OVERRIDE_TAG]}"
        )
    return lines
