"""The params reference page, generated from the params models' JSON schema at docs build time.

Every key's type, bounds and default come from ``Params.model_json_schema()``; its meaning from
the field's ``description`` in ``sat_model/config.py``, and a section's from its class docstring.
A field without a description fails the build (:class:`MissingDescriptionError`).

    python -m pipeline.docs.params   # print the page
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel

from pipeline.settings import Params
from sat_model.params import full_schema

__all__ = ["MissingDescriptionError", "params_page", "params_rows"]

_BOUNDS = (
    ("minimum", "≥"),
    ("exclusiveMinimum", ">"),
    ("maximum", "≤"),
    ("exclusiveMaximum", "<"),
)


class MissingDescriptionError(ValueError):
    """A params field or section that the reference would have to leave unexplained."""


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if ref else node


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    node = _resolve(node, defs)
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "anyOf" in node:
        return " or ".join(_type(n, defs) for n in node["anyOf"])
    kind = node.get("type", "any")
    if kind == "array":
        if "prefixItems" in node:
            return "[" + ", ".join(_type(n, defs) for n in node["prefixItems"]) + "]"
        return "list of " + _type(node.get("items", {}), defs)
    bounds = [f"{sign} {node[key]}" for key, sign in _BOUNDS if key in node]
    return f"{kind} {', '.join(bounds)}" if bounds else kind


def params_rows(
    model: type[BaseModel] | None = None,
) -> Iterator[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """Yield ``(section key, section description, rows)`` for every section, depth first;
    each row is ``(key, type, default, description)``. The default model is the whole of
    params with every registered source's section (:func:`sat_model.params.full_schema`)."""
    schema = (model or full_schema(Params)).model_json_schema()
    defs = schema.get("$defs", {})

    def walk(prefix: str, node: dict[str, Any]) -> Iterator[Any]:
        rows, sections = [], []
        for name, prop in node.get("properties", {}).items():
            key = f"{prefix}.{name}" if prefix else name
            target = _resolve(prop, defs)
            if target.get("type") == "object" and "properties" in target:
                sections.append((key, target))
                continue
            if not prop.get("description"):
                raise MissingDescriptionError(f"params key {key} has no Field(description=...)")
            default = json.dumps(prop.get("default"), ensure_ascii=False)
            rows.append((key, _type(prop, defs), f"`{default}`", prop["description"]))
        if prefix:
            if not node.get("description"):
                raise MissingDescriptionError(f"params section {prefix} has no docstring")
            yield prefix, node["description"], rows
        for key, target in sections:
            yield from walk(key, target)

    yield from walk("", schema)


def _cell(text: str) -> str:
    """One line, its bare pipes escaped (the type's own separators already are)."""
    return re.sub(r"(?<!\\)\|", r"\\|", " ".join(text.split()))


def params_page(model: type[BaseModel] | None = None) -> str:
    """The markdown page: one table per section, every leaf key a row."""
    lines = [
        "# Params reference",
        "",
        "`params.yaml` has one section per concern. It is loaded into frozen, typed models "
        "(`sat_model/config.py`, the pipeline's sections in `pipeline/settings.py`, each data "
        "source's in its module of `sat_model/data/sources/`) that reject unknown keys and "
        "wrong types and name the dotted key (`train.soft.lr: Input should be a valid "
        "number`). Override any key the DVC way, "
        "`dvc exp run -S train.soft.lr=2e-4`, or on a `sat` command, `sat train -S "
        "train.soft.lr=2e-4`.",
        "",
        "This page is generated from those models' JSON schema when the site is built.",
    ]
    for key, description, rows in params_rows(model):
        level = "#" * min(2 + key.count("."), 4)
        lines += ["", f"{level} `{key}`", "", " ".join(description.split())]
        if rows:
            lines += ["", "| key | type | default | meaning |", "|---|---|---|---|"]
            for row_key, type_name, default, meaning in rows:
                cells = (f"`{row_key}`", _cell(type_name), _cell(default), _cell(meaning))
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    print(params_page(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
