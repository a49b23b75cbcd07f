"""docs/METHOD.md points into ``sat_model/model/decoder.py``: equation -> function -> line."""

from __future__ import annotations

import re

from tests.factories import ROOT

ROW = re.compile(r"^\| (?P<eq>[^|]+) \| `(?P<name>[\w.]+)`[^|]* \| decoder\.py:(?P<line>\d+) \|$")


def test_every_equation_row_names_the_function_defined_on_its_line() -> None:
    lines = (ROOT / "sat_model" / "model" / "decoder.py").read_text(encoding="utf-8").splitlines()
    rows = [m for m in map(ROW.match, (ROOT / "docs" / "METHOD.md").read_text().splitlines()) if m]
    assert len(rows) >= 8, "METHOD.md lost its table of where each equation lives"
    for row in rows:
        *owner, function = row["name"].split(".")
        number = int(row["line"])
        assert re.match(rf"\s*def {function}\(", lines[number - 1]), (row["eq"], number)
        if owner:  # the nearest class above the line is the one named
            classes = [line for line in lines[:number] if line.startswith("class ")]
            assert classes[-1].startswith(f"class {owner[0]}("), (row["eq"], classes[-1])
