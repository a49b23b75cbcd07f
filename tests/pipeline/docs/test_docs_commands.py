"""Every command the docs name still runs: a stale one fails here, not in a reader's terminal.

The pages (README.md and docs/**/*.md) are read for ``python -m …``, ``python <script>.py``,
``sat …`` and ``make …``, in code blocks and in inline code. Each module or script of this
repository answers ``--help`` (all of them in one interpreter, so imports are paid once) and
lists every option the page gives it; each ``sat`` command is walked through the real parser
in-process; each ``make`` target is dry-run (``make -n``). Environment variables named
``SAT_…`` must still be read by the code, and the repository files a page names must exist.
The quickstart's Python snippet runs as written, on a model folder of a tiny model.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from tests.factories import ROOT, write_tiny_model

OURS = ("sat_model", "pipeline", "benchmarks")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
ENV_VAR = re.compile(r"\bSAT_[A-Z][A-Z0-9_]+\b")
REPO_FILE = re.compile(
    r"(?<![\w/.-])(?:sat_model|pipeline|benchmarks|tests)/[\w./-]*\.(?:py|cpp)\b"
)
TEST_ROOTS = ("", "tests/")  # a page may name a test module from tests/
SHELLS = {"", "bash", "sh", "shell", "console"}
PLACEHOLDER = re.compile(r"[<>…]|\.\.\.|\bX\b")

# Runs each (kind, target) with --help in this one process and prints {target: [code, text]}.
HELPER = r"""
import contextlib, io, json, runpy, signal, sys, warnings
warnings.simplefilter("ignore")
def _timeout(*_):
    raise TimeoutError("did not answer --help within 60 s")
signal.signal(signal.SIGALRM, _timeout)
out = {}
for kind, target in json.loads(sys.argv[1]):
    buf = io.StringIO()
    sys.argv = [target, "--help"]
    signal.alarm(60)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        code = repr(e)
    finally:
        signal.alarm(0)
    out[target] = [code, buf.getvalue()[-20000:]]
print(json.dumps(out))
"""


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _shell_lines(text: str) -> Iterator[str]:
    """Command lines of a page: its shell blocks' lines (continuations joined, comments cut)
    and its inline code, split at ``&&``, ``;`` and ``|``."""
    spans = []
    for lang, body in FENCE.findall(text):
        if lang in SHELLS:
            spans += body.replace("\\\n", " ").splitlines()
    spans += INLINE.findall(FENCE.sub("", text))
    for span in spans:
        span = re.sub(r"(^|\s)#.*", "", span).strip().removeprefix("$ ")
        yield from (part.strip() for part in re.split(r"&&|;|\|", span) if part.strip())


def _tokens(line: str) -> list[str]:
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    while words and (("=" in words[0] and not words[0].startswith("-")) or words[0] == "time"):
        words = words[1:]  # environment assignments
    if words:
        words[0] = words[0].rsplit("/", 1)[-1]  # .venv/bin/sat -> sat
    return words


def commands(text: str) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(kind, target, options) of every command of ours in ``text``: kind is ``module``,
    ``script``, ``sat`` or ``make``."""
    for line in _shell_lines(text):
        words = _tokens(line)
        if not words:
            continue
        head, rest = words[0], words[1:]
        if re.fullmatch(r"python(3(\.\d+)?)?", head) and rest:
            if rest[0] == "-m" and len(rest) > 1 and rest[1].split(".")[0] in OURS:
                if not PLACEHOLDER.search(rest[1]):
                    yield "module", rest[1], _options(rest[2:])
            elif rest[0].endswith(".py") and rest[0].split("/")[0] in OURS:
                yield "script", rest[0], _options(rest[1:])
        elif head == "sat" and not (rest and rest[0].endswith(":")):  # not `sat serve: error: …`
            yield "sat", "sat", tuple(rest)
        elif head == "make" and rest and not rest[0].startswith("-"):
            yield "make", "make", tuple(w for w in rest if not PLACEHOLDER.search(w))


def _options(words: list[str]) -> tuple[str, ...]:
    """The options given, up to ``--`` (what follows belongs to another command)."""
    if "--" in words:
        words = words[: words.index("--")]
    return tuple(w.split("=")[0].strip("[]") for w in words if w.startswith("-") and len(w) > 1)


def collect(root: Path = ROOT) -> dict[tuple[str, str], set[tuple[str, ...]]]:
    """Every command of every page, by (kind, target), with where each was found."""
    found: dict[tuple[str, str], set[tuple[str, ...]]] = {}
    for page in pages(root):
        for kind, target, options in commands(page.read_text(encoding="utf-8")):
            found.setdefault((kind, target), set()).add((str(page.relative_to(root)), *options))
    return found


def help_texts(targets: list[tuple[str, str]], root: Path = ROOT) -> dict[str, list]:
    """``--help`` of each module or script, all in one interpreter."""
    run = subprocess.run(
        [sys.executable, "-c", HELPER, json.dumps(targets)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(root), "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def stale_python(found: dict, root: Path = ROOT) -> list[str]:
    targets = sorted(k for k in found if k[0] in ("module", "script"))
    helps = help_texts(targets, root)
    bad = []
    for kind, target in targets:
        code, text = helps[target]
        if code != 0:
            pages_ = sorted({page for page, *_ in found[kind, target]})
            bad.append(f"{', '.join(pages_)}: `{target} --help` failed ({code}): {text[-300:]}")
            continue
        for page, *options in found[kind, target]:
            bad += [f"{page}: `{target}` has no option {o}" for o in options if o not in text]
    return bad


def stale_sat(words: tuple[str, ...]) -> str | None:
    """Why ``sat <words>`` is not a command of the parser, or None."""
    import argparse

    from pipeline.cli.main import build_parser

    parser = build_parser()
    path = [parser]
    marks = [i for i, w in enumerate(words) if PLACEHOLDER.search(w)]
    words = words[: marks[0]] if marks else words  # `sat <command>`: a pattern from there on
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            flag = word.split("=")[0]
            known = [
                p._option_string_actions[flag] for p in path if flag in p._option_string_actions
            ]
            if not known:
                return f"`sat {' '.join(words)}`: no option {flag}"
            skip = "=" not in word and known[-1].nargs != 0  # the option's value is next
        else:
            subs = [a for a in path[-1]._actions if isinstance(a, argparse._SubParsersAction)]
            if subs and word not in subs[0].choices:
                return f"`sat {' '.join(words)}`: no command {word!r}"
            if subs:
                path.append(subs[0].choices[word])
    return None


def stale_make(found: dict, root: Path = ROOT) -> list[str]:
    bad = []
    for page, *args in found.get(("make", "make"), ()):
        run = subprocess.run(["make", "-n", *args], cwd=root, capture_output=True, text=True)
        if run.returncode != 0:
            bad.append(f"{page}: `make {' '.join(args)}`: {run.stderr.strip()[-200:]}")
    return bad


def stale_names(root: Path = ROOT) -> list[str]:
    """Environment variables no code reads, repository files that do not exist."""
    code = "\n".join(
        p.read_text(encoding="utf-8")
        for d in OURS
        for p in (root / d).rglob("*")
        if p.suffix in {".py", ".cpp"}
    )
    bad = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(root)
        bad += [
            f"{name}: {v} is read by no code"
            for v in set(ENV_VAR.findall(text)) - set(ENV_VAR.findall(code))
        ]
        bad += [
            f"{name}: {f} does not exist"
            for f in sorted(set(REPO_FILE.findall(text)))
            if not any((root / r / f).exists() for r in TEST_ROOTS)
        ]
    return bad


def test_every_python_command_of_the_docs_answers_help_with_its_options() -> None:
    found = collect()
    assert any(k[0] == "module" for k in found)  # the reader found some
    bad = stale_python(found)
    assert not bad, "\n".join(bad)


def test_every_sat_command_of_the_docs_is_one_the_parser_knows() -> None:
    found = collect()
    calls = found[("sat", "sat")]
    assert len(calls) > 10
    bad = [f"{page}: {why}" for page, *words in calls if (why := stale_sat(tuple(words)))]
    assert not bad, "\n".join(bad)


def test_every_make_command_of_the_docs_is_a_target() -> None:
    bad = stale_make(collect())
    assert not bad, "\n".join(bad)


def test_every_variable_and_file_the_docs_name_exists() -> None:
    bad = stale_names()
    assert not bad, "\n".join(bad)


STALE_PAGE = """# A page gone stale

```bash
python -m pipeline.results_doc --write      # moved to pipeline.docs.results
.venv/bin/python benchmarks/bench_model.py --no-such-option
sat caption --no-such-flag photo.jpg
make no-such-target
```

Run `python -m pipeline.profiles`, or `sat nonesuch`; `SAT_NATIVE_KERNELS=0` turns them off;
the reference is `benchmarks/reference_model.py`.
"""


def test_the_checks_fail_on_stale_commands(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "stale.md").write_text(STALE_PAGE)
    (tmp_path / "README.md").write_text("`sat caption photo.jpg --attention-out out/`\n")
    for d in OURS:
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / "Makefile").symlink_to(ROOT / "Makefile")
    found = collect(tmp_path)
    python = "\n".join(stale_python(found, tmp_path))
    assert "pipeline.results_doc --help` failed" in python
    assert "pipeline.profiles --help` failed" in python
    assert "benchmarks/bench_model.py` has no option --no-such-option" in python
    sat = [stale_sat(tuple(words)) for _, *words in found[("sat", "sat")]]
    assert sum(why is not None for why in sat) == 2  # the README's command is a real one
    assert "no-such-target" in "\n".join(stale_make(found, tmp_path))
    names = "\n".join(stale_names(tmp_path))
    assert "SAT_NATIVE_KERNELS is read by no code" in names
    assert "benchmarks/reference_model.py does not exist" in names


def test_the_quickstarts_python_snippet_captions_a_photo_from_a_model_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "docs" / "guide" / "quickstart.md").read_text(encoding="utf-8")
    [snippet] = [body for lang, body in FENCE.findall(text) if lang == "python"]
    words = ("a", "red", "circle", "on", "grass")
    write_tiny_model(tmp_path / "models" / "soft", words=words)  # 64-px crops, 4x4 cells
    photo = tmp_path / "data" / "prepared" / "images" / "test_00000.png"
    photo.parent.mkdir(parents=True)
    Image.new("RGB", (90, 70), (200, 40, 40)).save(photo)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/guide/quickstart.md", "exec"), {"__name__": "__main__"})
    caption, shape = capsys.readouterr().out.splitlines()
    assert caption.split() and set(caption.split()) <= set(words)
    assert shape == f"({len(caption.split())}, 16)"  # an α over the 16 cells per word
