"""The quickstart (docs/guide/quickstart.md), walked by its own command blocks as written.

The blocks are read from the page, so an edit to the page changes what runs. They run in a
fresh git repository holding this working tree's files, whose ``params.yaml`` is shrunk to a
tiny pipeline (``test_dvc_pipeline.TINY``: the same commands on smaller data, so `make run`
takes minutes, not the default's eight). Two departures, both outside the commands' text:
``.venv`` in the copy links to the environment running the tests (``make run`` would otherwise
install one; the copy's ``pyproject.toml`` is dated before that environment's install so make
sees it current), and ``serve.port`` is a free port, written into the copy's params and put in
place of 8080 in the request, so a server already on 8080 cannot answer for ours. `sat serve`
runs in the background and is stopped by its PID.

The README's command blocks are lines of this page (a test checks it), so they are walked too.
The Flickr8k profile (two hours on the real photos) and the own-data blocks (a user's
``~/photos``) are not run here: each says why, and tests/pipeline/test_own_data.py walks the
own-data commands on a folder of sample photos.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sat_model.config import apply_overrides, read_yaml
from tests.pipeline.servers import _wait_for_port, free_port, stop_process_group
from tests.pipeline.test_dvc_pipeline import TINY, _env
from tests.pipeline.test_own_data import _project

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "quickstart.md"
VENV = Path(sys.prefix)
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

# blocks that this test does not run, by their first line, and why
NOT_RUN = {
    "make run PROFILE=flickr8k": "needs the Flickr8k photos and about two hours of training",
    ".venv/bin/sat profile new mine": (
        "needs your ~/photos; tests/pipeline/test_own_data.py walks these commands on a "
        "folder of sample photos"
    ),
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.mlflow,
    pytest.mark.java,
    pytest.mark.skipif(shutil.which("java") is None, reason="METEOR and PTB need Java"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="the request is sent with curl"),
    pytest.mark.skipif(
        not (VENV / ".installed").is_file(), reason="tests run outside the project's .venv"
    ),
]


def quickstart_blocks() -> list[str]:
    """The page's ``bash`` blocks, in order."""
    return BLOCK.findall(PAGE.read_text(encoding="utf-8"))


def _bash(project: Path, block: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
        **kw,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project, tiny params and a free serving port, `.venv` this environment."""
    root = _project(tmp_path_factory.mktemp("quickstart"))
    params = root / "params.yaml"
    port = free_port()
    raw = apply_overrides(read_yaml(params.read_text()), [*TINY, f"serve.port={port}"])
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    (root / ".venv").symlink_to(VENV)
    os.utime(root / "pyproject.toml", (0, 0))  # older than .venv/.installed: make installs nothing
    (root / "port").write_text(str(port))
    return root


def test_every_quickstart_block_is_run_here_or_says_why_not() -> None:
    blocks = quickstart_blocks()
    run = [b for b in blocks if not any(b.startswith(k) for k in NOT_RUN)]
    assert [b.splitlines()[0] for b in run[:3]] == [
        "make run",
        ".venv/bin/sat caption data/prepared/images/test_00000.png --attention-out attention/",
        ".venv/bin/sat serve",
    ]
    assert len(run) == 4, "a new quickstart block: run it below or say in NOT_RUN why not"
    assert all(any(b.startswith(k) for b in blocks) for k in NOT_RUN), "NOT_RUN is stale"


def test_quickstart_from_make_run_to_a_served_caption(project: Path) -> None:
    make_run, caption, serve, request = [
        b for b in quickstart_blocks() if not any(b.startswith(k) for k in NOT_RUN)
    ]
    out = _bash(project, make_run)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^soft\s+0\.\d{4}", out.stdout, re.M), out.stdout
    assert "champion: sat-captioner version 1" in out.stdout

    out = _bash(project, caption)
    assert out.returncode == 0, out.stderr
    assert re.search(r"test_00000\.png\S*\s+\w+", out.stdout), out.stdout
    assert (project / "attention/images/test_00000.png").is_file(), "no attention figure"
    assert "test_00000.png" in (project / "attention/index.html").read_text()

    port = (project / "port").read_text()
    server = subprocess.Popen(
        ["bash", "-c", serve], cwd=project, env=_env(), start_new_session=True, text=True
    )
    try:
        _wait_for_port(int(port), server, "sat serve", timeout_s=120)
        out = _bash(project, request.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
    finally:
        stop_process_group(server)
    assert out.returncode == 0, out.stderr
    (prediction,) = json.loads(out.stdout)["predictions"]
    assert prediction["error"] is None
    assert isinstance(prediction["caption"], str) and prediction["caption"].split()


def test_every_readme_command_is_a_quickstart_command() -> None:
    """The README's blocks are the quickstart's lines (and `make test`, which runs this), so
    walking the quickstart walks them."""
    readme = BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    quickstart = {line for b in quickstart_blocks() for line in b.splitlines()}
    commands = [line.split("#")[0].strip() for b in readme for line in b.splitlines()]
    assert "make run" in commands and "make test" in commands
    missing = [c for c in commands if c and c != "make test" and c not in quickstart]
    assert not missing, f"README commands the quickstart does not walk: {missing}"


@pytest.mark.parametrize("first_line", sorted(NOT_RUN))
def test_quickstart_blocks_not_run_here(first_line: str) -> None:
    pytest.skip(f"`{first_line}`: {NOT_RUN[first_line]}")
