"""``sat serve``: the champion (or any model URI) behind MLflow's scoring server on 127.0.0.1.

The model is fetched once into a temporary folder (a missing champion or a bad URI is one line
and exit 1, before any server starts), then ``mlflow models serve --env-manager local`` runs it
with this environment's ``bin/`` first on PATH. The ``serve`` params reach the model through
MLflow's model config (``SERVING_MODEL_CONFIG``: ``context.model_config["serve"]``), and
``serve.max_concurrent_requests`` + 1 becomes uvicorn's ``--limit-concurrency`` (through its
``UVICORN_LIMIT_CONCURRENCY`` variable; ``mlflow models serve`` has no such option).

MLflow 3.17's scoring server reads a whole request body before the model sees it and has no
body-size option (nor has uvicorn): ``serve.max_request_bytes`` is enforced in ``predict``, on
the image data. On an untrusted network, put a proxy with a body limit in front.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.stages import add_params_args, project_root

__all__ = ["ServeError", "add_parser", "fetch_model", "main", "serve_command"]


class ServeError(RuntimeError):
    """A user error that stops ``sat serve`` before a server starts (one line, exit 1)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``sat serve`` on the ``sat`` command's subparsers."""
    p = subparsers.add_parser(
        "serve", help="serve the champion over HTTP (MLflow's scoring server, 127.0.0.1)"
    )
    add_params_args(p)
    p.add_argument(
        "--model",
        default=None,
        help="models:/, runs:/ URI or a local MLflow model "
        "folder (default: models:/<mlflow.model_name>@champion)",
    )
    p.add_argument("--host", default=None, help="default: serve.host (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: serve.port")
    p.set_defaults(handler=main)


def _load_params(args: argparse.Namespace) -> Any:
    from sat_model.config import Params, load_params

    if not Path(args.params).exists() and not args.overrides:
        return Params()  # outside a project: defaults and MLFLOW_TRACKING_URI
    return load_params(args.params, args.overrides)


def fetch_model(model_uri: str, tracking_uri: str, dst: Path) -> Path:
    """Download ``model_uri`` (or check a local folder); raise :class:`ServeError` if unusable."""
    local = Path(model_uri).expanduser()
    if "://" not in model_uri and ":/" not in model_uri:
        if not (local / "MLmodel").is_file():
            raise ServeError(f"{model_uri} is not an MLflow model folder (no MLmodel file)")
        return local.resolve()
    import mlflow
    from mlflow.exceptions import MlflowException

    if tracking_uri.startswith("sqlite:///") and model_uri.startswith(("models:/", "runs:/")):
        store = Path(tracking_uri.removeprefix("sqlite:///"))  # four slashes: absolute
        if not store.is_file():  # MLflow would create an empty store and then not find it
            raise ServeError(f"cannot load {model_uri}: there is no MLflow store at {store}")
    try:
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=model_uri, dst_path=str(dst), tracking_uri=tracking_uri
        )
    except (MlflowException, OSError) as e:
        first = str(getattr(e, "message", e)).strip().splitlines()[0][:300]
        raise ServeError(f"cannot load {model_uri} from {tracking_uri}: {first}") from None
    if not (Path(path) / "MLmodel").is_file():
        raise ServeError(f"{model_uri} is not an MLflow model (no MLmodel file)")
    return Path(path)


def serve_command(model_dir: Path, host: str, port: int, serve: Any) -> tuple[list[str], dict]:
    """The ``mlflow models serve`` command line and its environment."""
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SERVING_MODEL_CONFIG": json.dumps({"serve": serve.model_dump(mode="json")}),
        # uvicorn answers 503 once open connections reach the limit, its own one included
        "UVICORN_LIMIT_CONCURRENCY": str(serve.max_concurrent_requests + 1),
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    command = [
        str(bin_dir / "mlflow"),
        "models",
        "serve",
        "-m",
        str(model_dir),
        "--env-manager",
        "local",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    return command, env


def _run(command: list[str], env: dict) -> int:
    """Run the server in the foreground; SIGTERM and Ctrl-C stop it."""
    process = subprocess.Popen(command, env=env)

    def stop(signum: int, frame: Any) -> None:
        process.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        return process.wait()


def main(args: argparse.Namespace) -> int:
    """``sat serve``: fetch the model, then run MLflow's scoring server until stopped."""
    from pipeline.tracking import resolve_tracking_uri
    from sat_model.config import ParamsError

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "alembic"):  # store migrations and downloads log at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        params = _load_params(args)
        tracking_uri = resolve_tracking_uri(params.mlflow, project_root(args.params))
        # the registry (models:/ URIs) and the scoring server follow the tracking URI
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
        model_uri = args.model or f"models:/{params.mlflow.model_name}@champion"
        with tempfile.TemporaryDirectory(prefix="sat-serve-") as tmp:
            model_dir = fetch_model(model_uri, tracking_uri, Path(tmp))
            host = args.host or params.serve.host
            port = params.serve.port if args.port is None else args.port
            print(f"serving {model_uri} on http://{host}:{port}/invocations", flush=True)
            return _run(*serve_command(model_dir, host, port, params.serve))
    except (ServeError, ParamsError) as e:
        hint = ""
        if args.model is None and isinstance(e, ServeError):
            hint = " (run `make run` to register a champion, or pass --model)"
        message = str(e).replace(":\n  ", ": ").replace("\n  ", "; ")
        print(f"sat serve: error: {message}{hint}", file=sys.stderr)
        return 1
