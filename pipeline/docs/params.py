"""Generate the README's params reference from the params models, so it cannot drift.

Each row is one leaf key: dotted path, type, default, and the why-comment written beside (or
just above) the field in ``sat_model/config.py``.

    python -m pipeline.docs.params           # print the table
    python -m pipeline.docs.params --write   # rewrite README.md between the params markers
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from sat_model.atomic import write_text_atomic
from sat_model.config import Params

__all__ = ["params_table", "replace_between", "update_readme"]

START, END = "<!-- params:start -->", "<!-- params:end -->"
_FIELD = re.compile(r"^\s+(\w+):[^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s*(.*)$")


def _field_comments(cls: type[BaseModel]) -> dict[str, str]:
    """Map field name -> its trailing comment, or the comment lines just above it."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        pending: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            if m := _COMMENT.match(line):
                pending.append(m.group(1))
                continue
            if (m := _FIELD.match(line)) and m.group(1) in klass.model_fields:
                out[m.group(1)] = m.group(2) or " ".join(pending)
            pending = []
    return out


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if get_origin(annotation) is tuple:
        return "list of " + _type_name(get_args(annotation)[0])
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("|", "or")


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str, str]]:
    comments = _field_comments(model)
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _rows(annotation, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, tuple):
            default = list(default)
        yield key, _type_name(annotation), repr(default), comments.get(name, "")


def params_table() -> str:
    """The markdown table of every params key."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, comment in _rows(Params, ""):
        cells = (key, type_name, default, comment)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def replace_between(text: str, start: str, end: str, body: str) -> str:
    """Return ``text`` with what lies between the ``start`` and ``end`` markers set to ``body``."""
    head, sep, rest = text.partition(start)
    _, sep2, tail = rest.partition(end)
    if not (sep and sep2):
        raise ValueError(f"README lacks the markers {start} ... {end}")
    return f"{head}{start}\n{body}\n{end}{tail}"


def update_readme(text: str) -> str:
    """Return README text with the table between the params markers replaced."""
    return replace_between(text, START, END, params_table())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md in place")
    parser.add_argument("--readme", default="README.md")
    args = parser.parse_args(argv)
    if not args.write:
        print(params_table())
        return 0
    path = Path(args.readme)
    write_text_atomic(path, update_readme(path.read_text(encoding="utf-8")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
