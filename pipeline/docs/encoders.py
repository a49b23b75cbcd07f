"""The encoder table of the docs, from the registry (``@register_encoder``): a new encoder
appears in docs/guide/datasets.md when ``python -m pipeline.docs.results --write`` runs, and a
test fails while the committed page differs from the registry."""

from __future__ import annotations

from itertools import groupby

from sat_model.features.encoders import encoder_layers, encoder_packages, list_encoders

__all__ = ["encoder_table"]


def _quoted(names: list[str] | tuple[str, ...], sep: str = ", ") -> str:
    return sep.join(f"`{n}`" for n in names)


def _needs(names: list[str]) -> str:
    """The packages every one of ``names`` needs, then each one's own (``a / b``)."""
    common = [p for p in encoder_packages(names[0]) if all(p in encoder_packages(n) for n in names)]
    own = [[p for p in encoder_packages(n) if p not in common] for n in names]
    parts = [_quoted(common)] if common else []
    if any(own):
        parts.append(" / ".join(_quoted(o) for o in own))
    return ", ".join(parts) or "torch alone"


def encoder_table() -> str:
    """A markdown table: the registered encoders (``encoder.name``; those with the same layers
    on one row), their feature layers (the default first, as an empty ``encoder.layer`` picks
    it) and the packages each needs."""
    lines = [
        "| `encoder.name` | `encoder.layer` (first: the default) | needs |",
        "|---|---|---|",
    ]
    for layers, group in groupby(list_encoders(), key=encoder_layers):
        names = list(group)
        lines.append(f"| {_quoted(names, ' / ')} | {_quoted(layers)} | {_needs(names)} |")
    return "\n".join(lines)
