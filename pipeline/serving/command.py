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
import socket
import sys
from typing import Any

from pipeline.stages import add_params_args

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``sat serve`` on the ``sat`` command's subparsers."""
    from pipeline.cli.commands import add_command

    p = add_command(
        subparsers,
        "serve",
        summary="serve the champion over HTTP (127.0.0.1)",
        description="Serve the champion (models:/<mlflow.model_name>@champion) or --model over "
        "HTTP with MLflow's scoring protocol (POST /invocations), checked against the sha256 "
        "recorded when it was registered. No model, a bad URI or bad params: one line and "
        "status 1 before any server starts. The default pipeline's champion knows the "
        "generated scenes of shapes, not photos: for photos, make run PROFILE=flickr8k.",
        examples=[
            "sat serve",
            "sat serve --port 9000 --params profiles/flickr8k/params.yaml",
            "sat serve --engine ray  # Ray Serve replicas (serve.ray)",
        ],
    )
    add_params_args(p)
    p.add_argument(
        "--model",
        default=None,
        help="models:/, runs:/ URI or a local MLflow model "
        "folder (default: models:/<mlflow.model_name>@champion)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="default: serve.host (127.0.0.1); any other address is reachable from other "
        "machines, without authentication (a warning says so)",
    )
    p.add_argument("--port", type=_port, default=None, help="1-65535 (default: serve.port)")
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


def _port(text: str) -> int:
    """``--port``: a TCP port a server can listen on (0, "any free port", would be announced
    as 0)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: 1 to 65535")
    return port


def _check_address(host: str, port: int) -> None:
    """Warn about a host that other machines reach; an unknown host or a port that cannot be
    listened on (in use, privileged) is a ``CommandError`` before the model loads."""
    import ipaddress

    from pipeline.cli.commands import CommandError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise CommandError(f"cannot listen on {host}: {e.strerror or e} (see --host)") from None
    if not ipaddress.ip_address(address[0]).is_loopback:
        print(
            f"sat serve: warning: listening on {host}: other machines can send requests, and "
            "the server has no authentication",
            file=sys.stderr,
            flush=True,
        )
    try:
        with socket.socket(family, kind, proto) as probe:
            # as uvicorn binds: a port left in TIME_WAIT by a stopped server counts as free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise CommandError(
            f"cannot listen on {host}:{port}: {e.strerror or e} (choose another with --port)"
        ) from None


def _load(args: argparse.Namespace) -> tuple[Any, str, str, Any]:
    """The params, the tracking URI, the model URI and the loaded model; a model that cannot
    be served, or an address that cannot be listened on, is a ``CommandError`` (one line,
    status 1) before any server starts."""
    from pipeline.cli.commands import CommandError
    from pipeline.cli.project import params_or_defaults, tracking_uri
    from pipeline.serving.registered import ServeError, load_served_model

    params = params_or_defaults(args)  # outside a project: defaults and MLFLOW_TRACKING_URI
    _check_address(*_address(args, params))
    tracking = tracking_uri(args)
    model_uri = args.model or f"models:/{params.mlflow.model_name}@champion"
    try:
        served = load_served_model(model_uri, tracking, params.serve)
    except ServeError as e:
        hint = "" if args.model else " (run `make run` to register a champion, or pass --model)"
        raise CommandError(f"{e}{hint}") from None
    return params, tracking, model_uri, served


def main(args: argparse.Namespace) -> int:
    """``sat serve``: load the model, then serve it until stopped."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "alembic"):  # store migrations and downloads log at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    params, tracking_uri, model_uri, served = _load(args)
    from pipeline.cli.notices import scenes_notice
    from pipeline.serving.front_door import build_app
    from pipeline.serving.http_server import run_server

    host, port = _address(args, params)
    shown = f"{model_uri} (version {served.version})" if served.version else model_uri
    notice = scenes_notice(served.service.captioner.data_source)
    if notice:
        print(f"sat serve: note: {notice}", file=sys.stderr, flush=True)
    if args.engine == "ray":
        return _serve_on_ray(args, params, model_uri, tracking_uri, (host, port), shown)
    app = build_app(_predict(served.service), params.serve, _describe(served.describe()))
    print(f"serving {shown} on http://{host}:{port}/invocations", flush=True)
    run_server(app, host, port, params.serve.read_timeout_s)
    return 0


def _address(args: argparse.Namespace, params: Any) -> tuple[str, int]:
    """Where to listen: ``--host``/``--port``, else ``serve.host``/``serve.port``."""
    return args.host or params.serve.host, params.serve.port if args.port is None else args.port


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
