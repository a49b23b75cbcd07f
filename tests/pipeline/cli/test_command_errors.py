"""A mistaken ``sat`` command line is one line on stderr, before any work: a busy or impossible
port, a host other machines reach (a warning), a ``--params`` file that is not there.

Each command runs as a user runs it (a subprocess of the installed ``sat``) in an empty folder:
no project, no store, so nothing is served and nothing is written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SAT = Path(sys.executable).with_name("sat")
pytestmark = [
    pytest.mark.skipif(not SAT.exists(), reason=f"no sat command at {SAT}"),
    pytest.mark.slow,  # a subprocess per command, as a user runs it
]


def _sat(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run(
        [str(SAT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _one_error_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The single line of a failed command, checked for the convention; returned to read."""
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"sat {command}: error: "), line
    assert "serving" not in done.stdout, done.stdout  # nothing was announced
    return line


def test_serve_on_a_busy_port_says_so_before_loading_anything(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # no store here either: the port is checked first, in a fraction of the model's time
        line = _one_error_line(_sat("serve", "--port", str(port), cwd=tmp_path), "serve")
    assert f"127.0.0.1:{port}" in line and "in use" in line and "--port" in line


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_serve_refuses_a_port_outside_1_to_65535(tmp_path: Path, port: str) -> None:
    line = _one_error_line(_sat("serve", "--port", port, cwd=tmp_path), "serve")
    assert "--port" in line and port in line


def test_serve_on_every_interface_warns_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = _sat("serve", "--host", "0.0.0.0", "--port", str(port), cwd=tmp_path)
    warning, error = done.stderr.splitlines()  # then the missing champion, as anywhere else
    assert warning.startswith("sat serve: warning: listening on 0.0.0.0: other machines")
    assert error.startswith("sat serve: error: ") and "champion" in error
    assert done.returncode == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["models"],
        ["promote"],
        ["serve"],
        ["caption", "photo.png"],
        ["evaluate"],
        ["train", "--attention", "soft"],
        ["tune"],
    ],
    ids=lambda c: c[0],
)
def test_a_params_file_that_is_not_there_is_named_not_replaced_by_defaults(
    tmp_path: Path, command: list[str]
) -> None:
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "photo.png")
    done = _sat(*command, "--params", "profiles/mine/params.yaml", cwd=tmp_path)
    line = _one_error_line(done, command[0])
    assert line.endswith("params file not found: profiles/mine/params.yaml"), line
