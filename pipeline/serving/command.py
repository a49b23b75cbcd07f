"""``sat serve``: the champion (or any model URI) over HTTP on 127.0.0.1.

The model is fetched, its checkpoint checked against its recorded sha256 and loaded with the
installed ``sat_model`` (:mod:`pipeline.serving.registered`; a missing champion or a bad URI is
one line and exit 1, before any server starts); the downloaded files are removed once it is in
memory. Then the front door (:mod:`pipeline.serving.front_door`) serves it with uvicorn in this
process, so stopping or killing ``sat serve`` leaves no server and no folder behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.stages import add_params_args, project_root

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``sat serve`` on the ``sat`` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve the champion over HTTP (127.0.0.1)")
    add_params_args(p)
    p.add_argument(
        "--model",
        default=None,
        help="models:/, runs:/ URI or a local MLflow model "
        "folder (default: models:/<mlflow.model_name>@champion)",
    )
    p.add_argument("--host", default=None, help="default: serve.host (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: serve.port")
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this process (default); ray: Ray Serve, replicas and batching across "
        "requests (serve.ray)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="with --engine ray: the cluster to deploy to (default: ray.address, RAY_ADDRESS, "
        "else a local Ray)",
    )
    p.set_defaults(handler=main)


def _load_params(args: argparse.Namespace) -> Any:
    from sat_model.config import Params, load_params

    if not Path(args.params).exists() and not args.overrides:
        return Params()  # outside a project: defaults and MLFLOW_TRACKING_URI
    return load_params(args.params, args.overrides)


def main(args: argparse.Namespace) -> int:
    """``sat serve``: load the model, then serve it until stopped."""
    from pipeline.serving.front_door import build_app
    from pipeline.serving.http_server import run_server
    from pipeline.serving.registered import ServeError, load_served_model
    from pipeline.tracking.runs import resolve_tracking_uri
    from sat_model.config import ParamsError

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "alembic"):  # store migrations and downloads log at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        params = _load_params(args)
        tracking_uri = resolve_tracking_uri(params.mlflow, project_root(args.params))
        model_uri = args.model or f"models:/{params.mlflow.model_name}@champion"
        served = load_served_model(model_uri, tracking_uri, params.serve)
    except (ServeError, ParamsError) as e:
        hint = ""
        if args.model is None and isinstance(e, ServeError):
            hint = " (run `make run` to register a champion, or pass --model)"
        message = str(e).replace(":\n  ", ": ").replace("\n  ", "; ")
        print(f"sat serve: error: {message}{hint}", file=sys.stderr)
        return 1
    host = args.host or params.serve.host
    port = params.serve.port if args.port is None else args.port
    shown = f"{model_uri} (version {served.version})" if served.version else model_uri
    if args.engine == "ray":
        return _serve_on_ray(args, params, model_uri, tracking_uri, (host, port), shown)
    app = build_app(_predict(served.service), params.serve, _describe(served.describe()))
    print(f"serving {shown} on http://{host}:{port}/invocations", flush=True)
    run_server(app, host, port, params.serve.read_timeout_s)
    return 0


def _serve_on_ray(
    args: argparse.Namespace,
    params: Any,
    model_uri: str,
    tracking_uri: str,
    where: tuple[str, int],
    shown: str,
) -> int:
    """Deploy the model (checked by loading it here first) on Ray Serve until stopped."""
    from pipeline.ray.runtime import ray_session
    from pipeline.serving import ray_engine

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # one line per replica event
    with ray_session(params.ray, address=args.address):
        host, port = where
        print(f"serving {shown} on Ray Serve, http://{host}:{port}/invocations", flush=True)
        ray_engine.run(model_uri, tracking_uri, params.serve, host, port)
    return 0


def _predict(service: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    async def predict(values: list[Any], params: dict[str, Any]) -> list[dict[str, Any]]:
        beam, attention = params.get("beam_size"), bool(params.get("return_attention"))
        # a worker thread: PyTorch releases the GIL, the server keeps answering
        return await run_in_threadpool(service.caption_rows, values, beam, attention)

    return predict


def _describe(description: dict[str, Any]) -> Any:
    async def describe() -> dict[str, Any]:
        return description

    return describe
