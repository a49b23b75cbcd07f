"""A mistaken ``sat`` command line is one line on stderr, before any work: a busy or impossible
port, a host other machines reach (a warning), a ``--params`` file that is not there; and what
a command can check by itself is checked before PyTorch, Ray or MLflow is imported.

Each command runs as a user runs it (a subprocess of the installed ``sat``) in an empty folder:
no project, no store, so nothing is served and nothing is written.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import write_tiny_model

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


# runs each command line given with main(), in one process, then prints which of the heavy
# libraries any of them imported; a line starting with "+" is expected to succeed
_IMPORTS_DRIVER = """
import json, sys
from pipeline.cli.main import main
for line in sys.argv[1:]:
    ok = line.startswith("+")
    status = main(line.removeprefix("+").split())
    assert status == (0 if ok else 1), (line, status)
    print(json.dumps([line, sorted({"torch", "ray", "mlflow"} & set(sys.modules))]))
"""


def test_a_user_error_is_told_before_torch_ray_or_mlflow_is_imported(tmp_path: Path) -> None:
    """Missing paths, a missing store or params file, a wrong combination of options: each is
    told before the libraries that would do the work load; and a caption with a model folder
    never imports MLflow (it never talks to a store)."""
    from PIL import Image

    write_tiny_model(tmp_path / "model", words=("a", "dog", "runs"), resize=72)
    Image.new("RGB", (80, 60), "white").save(tmp_path / "photo.png")
    errors = [
        "caption nothere.jpg",
        "caption photo.png --out captions",  # --out is for --engine ray
        "caption photo.png --engine ray",  # ... which needs --out
        "models",  # no store here
        "card",
        "promote --metric cider",
        "review 2 --out r",  # no params.yaml here
        "train --attention soft",
        "evaluate",
    ]
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_DRIVER, *errors, "+caption photo.png --model model"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RAY_ADDRESS"))},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    imported = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert imported[errors[-1]] == [], imported  # after every error, none of them
    assert imported["+caption photo.png --model model"] == ["torch"]
