"""Loading ``params.yaml``: the YAML as DVC reads it, ``-S`` overrides, the schema
(:mod:`sat_model.config`, or the pipeline's, which extends it), then the checks that need the
registries: ``data.source``, ``encoder.name`` and ``train.monitor`` name registered entries, and
each source's section ``data.<source>`` is validated by the settings model its entry carries.

Overrides use the dotted syntax of ``dvc exp run -S`` (``train.soft.lr=2e-4``), parsed as YAML
scalars. A params file may hold only what differs from another: its ``extends`` key names the
file it overlays (:func:`read_params_file`).

Extensions outside this repository register through the entry-point group ``sat.plugins``:
each entry names a module, imported before params are checked (:func:`load_plugins`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError, create_model
from ruamel.yaml import YAMLError

from sat_model.config import DataConfig, EncoderConfig, LibraryParams, ParamsError, TrainConfig
from sat_model.data.sources.registry import SOURCES, list_sources
from sat_model.evaluation.metrics import metric_keys

__all__ = [
    "EXTENDS",
    "PLUGIN_GROUP",
    "apply_overrides",
    "full_schema",
    "load_params",
    "load_plugins",
    "read_params_file",
    "read_yaml",
    "validate_params",
]

P = TypeVar("P", bound=LibraryParams)
PLUGIN_GROUP = "sat.plugins"
EXTENDS = "extends"  # the params file this one overlays, relative to its own folder


def read_yaml(text: str) -> Any:
    """Parse YAML 1.2 as DVC does (ruamel.yaml's safe loader: ``2e-4`` is a number, ``yes`` a
    word, a repeated key an error; no object is ever constructed)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


def load_plugins() -> None:
    """Import every module of the ``sat.plugins`` entry points (once: imports are cached), so
    that what they register is known before params are checked."""
    for entry in entry_points(group=PLUGIN_GROUP):
        importlib.import_module(entry.value)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    out = read_yaml(yaml.safe_dump(raw)) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamsError(f"override {item!r} is not of the form key.path=value")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ParamsError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[leaf] = read_yaml(value)
    return out


def _merge(base: Any, overlay: Any) -> Any:
    """``overlay`` over ``base``: sections merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in overlay.items()}}
    return overlay


def read_params_file(path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping a params file holds, over the file its ``extends`` key names (the file then
    holds only what differs from that one)."""
    path = Path(path)
    try:
        raw = read_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as e:
        raise ParamsError(f"params file not found: {path}") from e
    except YAMLError as e:
        raise ParamsError(f"params file {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ParamsError(f"params file {path} must hold a mapping of sections")
    base = raw.pop(EXTENDS, None)
    if base is None:
        return raw
    if not isinstance(base, str) or path.resolve() in seen:
        raise ParamsError(f"{path}: {EXTENDS} must name another params file, not {base!r}")
    merged: dict[str, Any] = _merge(
        read_params_file(path.parent / base, (*seen, path.resolve())), raw
    )
    return merged


def load_params(
    path: str | Path = "params.yaml",
    overrides: list[str] | None = None,
    schema: type[P] = LibraryParams,  # type: ignore[assignment]
) -> P:
    """Load and validate ``params.yaml``; raise :class:`ParamsError` naming every bad key."""
    raw = apply_overrides(read_params_file(path), overrides or [])
    return validate_params(raw, schema)


def _tuples_from_lists(value: Any) -> Any:
    # YAML has no tuples; strict pydantic wants them for the frozen tuple fields.
    if isinstance(value, dict):
        return {k: _tuples_from_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples_from_lists(v) for v in value)
    return value


def _error_lines(err: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    lines = []
    for e in err.errors():
        # a validator's own message names its keys; pydantic's "Value error, " adds nothing
        msg = e["msg"].removeprefix("Value error, ")
        key = ".".join(str(p) for p in (*prefix, *e["loc"]))
        lines.append(f"{key}: {msg}" if key else msg)
    return lines


def _source_sections(data: Any, known: set[str]) -> tuple[dict[str, BaseModel], list[str]]:
    """Each registered source's settings from its ``data.<name>`` section (its defaults where
    there is none); errors for bad sections and for keys that are neither fields nor sources."""
    data = data if isinstance(data, dict) else {}
    sections: dict[str, BaseModel] = {}
    errors = []
    for name in SOURCES:
        model = SOURCES[name].settings
        if model is None:
            continue
        try:
            sections[name] = model.model_validate(data.get(name) or {})
        except ValidationError as e:
            errors += _error_lines(e, ("data", name))
    for key in sorted(set(data) - known - set(sections)):
        errors.append(f"data.{key}: Extra inputs are not permitted (not a setting, nor a source)")
    return sections, errors


def validate_params(raw: Mapping[str, Any], schema: type[P] = LibraryParams) -> P:  # type: ignore[assignment]
    """``raw`` (a params mapping, or a dumped ``LibraryParams``) validated by ``schema`` and checked
    against the registries; :class:`ParamsError` names every bad key."""
    load_plugins()
    tree: dict[str, Any] = _tuples_from_lists(dict(raw))
    data = tree.get("data", {})
    sections, errors = _source_sections(data, set(DataConfig.model_fields))
    if isinstance(data, dict):
        tree["data"] = {**{k: v for k, v in data.items() if k not in sections}, **sections}
    try:
        params = schema.model_validate(tree)
    except ValidationError as e:
        errors += _error_lines(e)
    errors += _registry_errors(tree)
    if errors:
        raise ParamsError("invalid params:\n  " + "\n  ".join(errors))
    return params


def full_schema(schema: type[P] = LibraryParams) -> type[P]:  # type: ignore[assignment]
    """``schema`` with every registered source's section in ``data`` as a typed field: what the
    params reference documents (a loaded ``data`` holds those sections as extra fields)."""
    load_plugins()
    sections: dict[str, Any] = {
        name: (model, model()) for name in SOURCES if (model := SOURCES[name].settings) is not None
    }
    data = create_model("DataConfig", __base__=DataConfig, __doc__=DataConfig.__doc__, **sections)
    full: type[P] = create_model(
        schema.__name__, __base__=schema, __doc__=schema.__doc__, data=(data, data())
    )
    return full


def _named(tree: Mapping[str, Any], section: str, key: str) -> Any:
    """``tree[section][key]``, or the schema's default: a name to check even where another key
    of params is invalid (every bad key is listed at once)."""
    node = tree.get(section)
    node = node if isinstance(node, Mapping) else {}
    models: dict[str, type[BaseModel]] = {
        "data": DataConfig,
        "encoder": EncoderConfig,
        "train": TrainConfig,
    }
    return node.get(key, models[section].model_fields[key].default)


def _registry_errors(tree: Mapping[str, Any]) -> list[str]:
    """The names params give that no registry holds, and a real source without its root."""
    errors = []
    source, encoder, monitor = (
        _named(tree, "data", "source"),
        _named(tree, "encoder", "name"),
        _named(tree, "train", "monitor"),
    )
    if source not in list_sources():
        errors.append(f"data.source: unknown data source {source!r}; registered: {list_sources()}")
    elif SOURCES[source].needs_root and not _named(tree, "data", "root"):
        errors.append(f"data: data.root is required for source {source!r}")
    from sat_model.features.encoders import list_encoders  # PyTorch: only once params are read

    if encoder not in list_encoders():
        errors.append(f"encoder.name: unknown encoder {encoder!r}; registered: {list_encoders()}")
    if monitor not in metric_keys():
        errors.append(
            f"train.monitor: {monitor!r} is not a key of a registered metric; "
            f"known: {list(metric_keys())}"
        )
    return errors
