"""Code comments say what and why; figures live in docs/results.md and docs/decisions/.

Every comment and string literal of ``sat_model/``, ``pipeline/`` and ``benchmarks/`` (Python
through :mod:`tokenize`, C++ by its comment markers) is searched for what belongs in the docs:
an issue number, a date, a timing or rate measured on some machine. A reason that is a
measurement cites ``decisions/NNN``, which must name a page that exists. The docs themselves
stay short enough to read: at most 20,000 words, no decision page over 1,200.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.factories import ROOT

CODE_DIRS = ("sat_model", "pipeline", "benchmarks")
DOCS = ROOT / "docs"
DOCS_MAX_WORDS = 20_000
DECISION_MAX_WORDS = 1_200

NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?"
# where a figure was taken: "on 2 cores", "on the 2-core CI", "on an H200", "here", "this machine"
MACHINE = (
    r"(?:\bon (?:the |this |a |an |one |two |\d+ )?(?:\d+-core )?"
    r"(?:cores?|CPUs?|GPUs?|machines?|Xeon|EPYC|laptop|CI|H100|H200|A100)\b"
    r"|\bthis machine\b|\bhere\b)"
)
TIME_UNIT = r"(?:ms|µs|us|s|sec|min|minutes?|seconds?|hours?|h)\b"
RATE_UNIT = r"(?:[GT]FLOP/s|images/s|captions/s|photos/s|it/s|MB/s|GB/s)"
FORBIDDEN = {
    "an issue number": re.compile(r"\bissues?\s*#?\d+|(?<![\w/.-])#\d+\b|\bpre-#\d+", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b"),
    "a machine timing": re.compile(rf"{NUMBER}\s?{TIME_UNIT}[^\n]{{0,60}}?{MACHINE}"),
    "CPU-seconds": re.compile(rf"{NUMBER}\s?CPU-s(?:econds?)?\b|\bCPU-s\b"),
    "a measured rate": re.compile(rf"{NUMBER}\s?{RATE_UNIT}[^\n]{{0,60}}?{MACHINE}"),
    "a measured speed-up": re.compile(
        rf"{NUMBER}\s?(?:x|%)\s(?:faster|slower)\b|{NUMBER}\s?x\b[^\n]{{0,60}}?{MACHINE}"
    ),
    "the deleted experiments logs": re.compile(r"(?<!docs/)\b(?:EXPERIMENTS|REALDATA)\.md\b"),
}
DECISION_CITE = re.compile(r"\bdecisions/(\d{3})\b")
DOCS_PAGE = re.compile(r"\bdocs/[\w/.-]+\.md\b")


def code_files() -> list[Path]:
    return sorted(
        p
        for d in CODE_DIRS
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".py", ".cpp"} and "__pycache__" not in p.parts
    )


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal: docstrings, messages, headers."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in kinds]


def cpp_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every ``//`` and ``/* */`` comment."""
    return [
        (source.count("\n", 0, m.start()) + 1, m.group())
        for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)
    ]


def findings(text: str) -> list[tuple[int, str]]:
    """(offset, phrase) of what ``text`` names that belongs in the docs."""
    found = []
    for what, pattern in FORBIDDEN.items():
        found += [(m.start(), f"{what}: {m.group()!r}") for m in pattern.finditer(text)]
    decisions = {p.name[:3] for p in (DOCS / "decisions").glob("[0-9][0-9][0-9]-*.md")}
    found += [
        (m.start(), f"a decision page that does not exist: {m.group()!r}")
        for m in DECISION_CITE.finditer(text)
        if m.group(1) not in decisions
    ]
    found += [
        (m.start(), f"a docs page that does not exist: {m.group()!r}")
        for m in DOCS_PAGE.finditer(text)
        if not (ROOT / m.group()).is_file()
    ]
    return found


@pytest.mark.parametrize("path", code_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_and_docstrings_carry_no_history_or_machine_figures(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    prose = python_prose(source) if path.suffix == ".py" else cpp_prose(source)
    bad: list[str] = []
    for line, text in prose:
        for offset, what in findings(text):
            bad.append(f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, offset)}: {what}")
    assert not bad, "cite docs/decisions/NNN instead:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("# the profile's make run: 105.3 min for 7,000 photos on 2 cores", "a machine timing"),
        ("# one-image decoding at the paper's sizes: ~25 s a round here", "a machine timing"),
        ('"""... (issue #20)."""', "an issue number"),
        ("// before issue 18 gave the encoder", "an issue number"),
        ("# names read pre-#18", "an issue number"),
        ("# measured 2026-11-24", "a date"),
        ("# about 12 CPU-seconds over the two cores", "CPU-seconds"),
        ("# ~170 against oneDNN's ~365 GFLOP/s on the 2-core CI", "a measured rate"),
        ("# the kernels ran ~8 % faster with it", "a measured speed-up"),
        ("# 6.3x the float32 rate on the 2-core Xeon here", "a measured speed-up"),
        ("# the log (REALDATA.md)", "the deleted experiments logs"),
        ("# the log (docs/EXPERIMENTS.md)", "a docs page that does not exist"),
        ("# the rule (docs/decisions/999)", "a decision page that does not exist"),
        ("# as the guide says (docs/guide/nowhere.md)", "a docs page that does not exist"),
    ],
)
def test_the_rules_catch_the_cases_they_are_for(text: str, what: str) -> None:
    assert any(f.startswith(what) for _, f in findings(text)), findings(text)


@pytest.mark.parametrize(
    "text",
    [
        "# seconds = ms / 1000",
        "# a tracking server that is down fails in seconds, each try at most 20 s",
        '"""``2m10s``, ``1h05m``, ``45s``: the ETA\'s resolution."""',
        "train soft  epoch 3/10  loss 3.412  612 captions/s  ETA 2m10s",
        "# waits at most 600 s for METEOR's Java process",
        "# checkpoints must load on a machine without the GPU they were trained on",
        "# Ray's own bug: ray-project/ray#53727",
        "# as in docs/METHOD.md and docs/decisions/001-backend-against-torch-compile.md",
        "# 224x224 images, 14x14 cells",
        "# a 50 % chance of the mirrored photo",
    ],
)
def test_the_rules_leave_ordinary_code_alone(text: str) -> None:
    assert findings(text) == []


def _words(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").split())


def test_the_docs_stay_short_enough_to_read() -> None:
    pages = sorted(DOCS.rglob("*.md"))
    total = sum(_words(p) for p in pages)
    assert total <= DOCS_MAX_WORDS, f"docs/ holds {total} words (at most {DOCS_MAX_WORDS})"
    long = {p.name: _words(p) for p in (DOCS / "decisions").glob("*.md")}
    assert all(n <= DECISION_MAX_WORDS for n in long.values()), long
