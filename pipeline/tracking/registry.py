"""The MLflow model registry's promotion policy: which version is `champion`.

Versions are identified by the sha256 of their checkpoint (tag ``sat.checkpoint_sha256``; logging
and registering a model is :mod:`pipeline.tracking.packaging`). The ``champion`` alias (aliases,
not the deprecated stages) moves only when a version beats the current champion on the chosen
metric, on the same split, and reaches the promotion floor
(:mod:`pipeline.tracking.governance.floor`);
every caption metric here is better when higher. :func:`promotion_allowed` says whether the
register stage may move it at all (``mlflow.promote``; not inside a ``dvc exp run`` by default).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.tracking.governance.floor import FLOOR_OVERRIDE_TAG, floor_misses, record_override
from pipeline.tracking.runs import ATTENTION_TAG, CHECKPOINT_TAG
from sat_model.model.checkpoint import model_files

__all__ = [
    "CHAMPION_ALIAS",
    "CHECKPOINT_TAG",
    "PromotionDecision",
    "PromotionResult",
    "RegistryError",
    "VersionInfo",
    "checkpoint_sha256",
    "current_champion",
    "decide_promotion",
    "list_versions",
    "promote",
    "promote_if_better",
    "promotion_allowed",
    "version_of",
    "versions_of_checkpoint",
]

CHAMPION_ALIAS = "champion"


class RegistryError(RuntimeError):
    """The registry cannot do what was asked (unknown version, a metric no version has)."""


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str


@dataclass(frozen=True)
class VersionInfo:
    """One registered version as ``sat models`` shows it."""

    version: str
    run_id: str | None  # the training run when it was known at registration
    attention: str | None
    metrics: Mapping[str, float]
    aliases: tuple[str, ...]
    checkpoint_sha256: str | None
    floor_override: str | None = None  # the reason it was promoted below the floor, if it was


@dataclass(frozen=True)
class PromotionResult:
    """What a promotion attempt did; written to ``reports/registry.json``."""

    model_name: str
    metric: str
    candidate: str
    candidate_value: float | None
    previous_champion: str | None
    previous_value: float | None
    champion: str | None
    promoted: bool
    reason: str
    extra: dict[str, Any] = field(default_factory=dict)


def decide_promotion(
    candidate: float | None, champion: float | None, misses: Sequence[str] = ()
) -> PromotionDecision:
    """The rule: promote when the candidate reaches the floor (``misses``: what it missed,
    :func:`~pipeline.tracking.governance.floor.floor_misses`) and there is no champion, or the
    candidate is strictly better.

    A tie keeps the incumbent (moving the alias on noise would churn what is being served); a
    candidate without the metric (or NaN) is never promoted.
    """
    if candidate is None or math.isnan(candidate):
        return PromotionDecision(False, "the candidate has no value for the metric")
    if misses:
        return PromotionDecision(False, "; ".join(misses) + " (promotion.floor)")
    if champion is None or math.isnan(champion):
        return PromotionDecision(True, "there is no champion yet")
    if candidate > champion:
        return PromotionDecision(True, f"{candidate:.4f} beats the champion's {champion:.4f}")
    if candidate == champion:
        return PromotionDecision(False, f"{candidate:.4f} only ties the champion")
    return PromotionDecision(False, f"{candidate:.4f} is below the champion's {champion:.4f}")


def checkpoint_sha256(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's files, each prefixed by its name (fixed order): what makes a
    model, its weights, model/encoder config and vocabulary (a new vocab is a new model)."""
    digest = hashlib.sha256()
    for name in model_files(model_dir):
        path = Path(model_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: not a model directory")
        digest.update(name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def versions_of_checkpoint(
    client: MlflowClient, model_name: str, sha256: str
) -> list[ModelVersion]:
    """The versions of ``model_name`` tagged with this checkpoint hash, oldest first."""
    found = client.search_model_versions(
        f"name = '{model_name}' and tags.`{CHECKPOINT_TAG}` = '{sha256}'"
    )
    return sorted(found, key=lambda v: int(v.version))


def _version_metrics(client: MlflowClient, version: ModelVersion) -> dict[str, float]:
    if not version.run_id:
        return {}
    return dict(client.get_run(version.run_id).data.metrics)


def _split_of(client: MlflowClient, version: ModelVersion) -> str | None:
    """The split the version was scored on (its run's ``eval.split``), None when unrecorded."""
    if not version.run_id:
        return None
    return client.get_run(version.run_id).data.params.get("eval.split")


def _other_split(client: MlflowClient, candidate: ModelVersion, incumbent: ModelVersion) -> str:
    """Why the two cannot be compared (scored on different splits), or "" when they can."""
    ours, theirs = _split_of(client, candidate), _split_of(client, incumbent)
    if ours and theirs and ours != theirs:
        return f"scored on {ours}, the champion on {theirs}: not comparable"
    return ""


def _metric_of(client: MlflowClient, version: ModelVersion, metric: str) -> float | None:
    return _version_metrics(client, version).get(metric)


def current_champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException as e:  # no such alias (or no such model) yet
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def version_of(
    client: MlflowClient, model_name: str, version: str | None = None, alias: str | None = None
) -> ModelVersion:
    """The version numbered ``version``, else the one ``alias`` names (a :class:`RegistryError`
    when there is none)."""
    try:
        if version is not None:
            return client.get_model_version(model_name, str(version))
        return client.get_model_version_by_alias(model_name, alias or CHAMPION_ALIAS)
    except MlflowException as e:
        which = f"version {version}" if version is not None else f"alias @{alias}"
        raise RegistryError(f"{model_name} has no {which}") from e


def _all_versions(client: MlflowClient, model_name: str) -> list[ModelVersion]:
    versions = client.search_model_versions(f"name = '{model_name}'")
    return sorted(versions, key=lambda v: int(v.version))


def list_versions(client: MlflowClient, model_name: str) -> list[VersionInfo]:
    """Every version of ``model_name`` with its run's metrics and its aliases, oldest first."""
    versions = _all_versions(client, model_name)
    if not versions:
        return []
    # search results carry no aliases on every store; the registered model always does
    aliases: dict[str, list[str]] = {}
    for alias, number in client.get_registered_model(model_name).aliases.items():
        aliases.setdefault(str(number), []).append(alias)
    rows = []
    for v in versions:
        rows.append(
            VersionInfo(
                version=str(v.version),
                run_id=v.run_id,
                attention=v.tags.get(ATTENTION_TAG),
                metrics=_version_metrics(client, v),
                aliases=tuple(sorted(aliases.get(str(v.version), []))),
                checkpoint_sha256=v.tags.get(CHECKPOINT_TAG),
                floor_override=v.tags.get(FLOOR_OVERRIDE_TAG),
            )
        )
    return rows


def _apply(
    client: MlflowClient,
    model_name: str,
    metric: str,
    candidate: ModelVersion,
    decision: PromotionDecision | None = None,
    floor: Mapping[str, float] | None = None,
) -> PromotionResult:
    """Decide (unless ``decision`` is given) and move the alias; ``floor`` as in
    :func:`promote_if_better`."""
    incumbent = current_champion(client, model_name)
    value = _metric_of(client, candidate, metric)
    previous = _metric_of(client, incumbent, metric) if incumbent else None
    split = _other_split(client, candidate, incumbent) if incumbent else ""
    if incumbent is not None and str(incumbent.version) == str(candidate.version):
        decision = PromotionDecision(False, "this version is already the champion")
    elif decision is None and split:
        decision = PromotionDecision(False, split)
    elif decision is None:
        misses = floor_misses(_version_metrics(client, candidate), floor or {})
        decision = decide_promotion(value, previous, misses)
        if misses:
            decision = PromotionDecision(
                False,
                f"{decision.reason}; `sat promote --version {candidate.version} "
                "--override-floor --reason TEXT` promotes it anyway",
            )
    if decision.promote:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(candidate.version))
    after = candidate if decision.promote else incumbent
    return PromotionResult(
        model_name=model_name,
        metric=metric,
        candidate=str(candidate.version),
        candidate_value=value,
        previous_champion=str(incumbent.version) if incumbent else None,
        previous_value=previous,
        champion=str(after.version) if after else None,
        promoted=decision.promote,
        reason=decision.reason,
    )


def promotion_allowed(
    policy: str, experiment: str | None, version: str = "<version>"
) -> tuple[bool, str]:
    """May the register stage move ``champion`` to ``version``? ``policy`` is ``mlflow.promote``.

    ``auto``: yes, except inside a DVC experiment (``experiment`` names it): an experiment
    registers its versions and leaves the champion alone (``sat promote`` moves it). ``always``:
    yes, experiments too (still only when better). ``never``: no, promotion is ``sat promote``.
    The reason for a no ends with the command that promotes ``version``.
    """
    command = f"`sat promote --version {version}`"
    if policy == "never":
        return False, f"mlflow.promote is never: {command} promotes it"
    if policy == "auto" and experiment is not None:
        return False, (
            f"registered from DVC experiment {experiment!r}, the champion stays: {command} "
            "promotes it (or mlflow.promote=always)"
        )
    return True, ""


def promote_if_better(
    client: MlflowClient,
    model_name: str,
    version: str,
    metric: str,
    floor: Mapping[str, float] | None = None,
) -> PromotionResult:
    """Move ``champion`` to ``version`` only if it reaches ``floor`` (``promotion.floor``: the
    least score per metric) and beats the current champion on ``metric``, on the same split."""
    chosen = client.get_model_version(model_name, str(version))
    return _apply(client, model_name, metric, chosen, floor=floor)


def promote(
    client: MlflowClient,
    model_name: str,
    metric: str,
    version: str | None = None,
    *,
    floor: Mapping[str, float] | None = None,
    override_reason: str | None = None,
) -> PromotionResult:
    """``sat promote``: make ``version`` the champion, or else the best version on ``metric``
    among those that reach ``floor``.

    A named version is promoted whatever its rank (the user decided) but not below the floor,
    unless ``override_reason`` says why: then the reason and what it missed are recorded on the
    version. Otherwise the best-scoring version is picked (ties go to the older version, which
    has served longest).
    """
    if version is not None:
        try:
            chosen = client.get_model_version(model_name, str(version))
        except MlflowException as e:
            raise RegistryError(f"{model_name} has no version {version!r}") from e
        misses = floor_misses(_version_metrics(client, chosen), floor or {})
        if misses and not override_reason:
            raise RegistryError(
                f"version {version} is below the promotion floor: {'; '.join(misses)}; "
                "--override-floor --reason TEXT promotes it anyway (recorded on the version)"
            )
        why = "requested"
        if misses and override_reason:
            record_override(client, model_name, str(chosen.version), override_reason, misses)
            why = f"requested below the floor ({'; '.join(misses)}): {override_reason}"
        return _apply(client, model_name, metric, chosen, PromotionDecision(True, why))
    scored = [
        (v, value)
        for v, value in _scored_versions(client, model_name, metric)
        if not floor_misses(_version_metrics(client, v), floor or {})
    ]
    if not scored:
        raise RegistryError(
            f"no version of {model_name!r} reaches the promotion floor {dict(floor or {})}: "
            "name one with --version (and --override-floor --reason TEXT)"
        )
    best_value = max(value for _, value in scored)
    best = next(v for v, value in scored if value == best_value)
    return _apply(client, model_name, metric, best, PromotionDecision(True, "best on " + metric))


def _scored_versions(
    client: MlflowClient, model_name: str, metric: str
) -> Sequence[tuple[ModelVersion, float]]:
    scored = []
    for v in _all_versions(client, model_name):
        value = _metric_of(client, v, metric)
        if value is not None and not math.isnan(value):
            scored.append((v, value))
    if not scored:
        raise RegistryError(f"no version of {model_name!r} has a value for metric {metric!r}")
    return scored
