"""``sat serve --engine ray``: the champion on Ray Serve replicas, behind the same front door.

The front door of :mod:`pipeline.serving.front_door` runs in the ``sat serve`` process with
uvicorn (:mod:`pipeline.serving.http_server`), as it does for the local engine, and hands the
rows of each request it admits to the model's Serve deployment, ``CaptionModel``, through a
deployment handle. Serve's own HTTP proxy is not started: it reads a whole body into memory
before any application sees it (Ray Serve has no setting that bounds a body), takes any pace
and keeps idle sockets open; so no client byte reaches Ray but rows the front door has checked.
Concurrent requests meet in ``@serve.batch`` and are captioned together, their images sharing
one batched beam search. Replicas scale between ``serve.ray.min_replicas`` and
``max_replicas`` on the requests in flight. Every ``serve.ray.reload_interval_s`` each replica
looks at the alias it serves (``@champion``); when ``sat promote`` has moved it, the replica
loads the new version (checked against its recorded sha256, :mod:`pipeline.serving.registered`)
and serves it from then on; a version that fails its check is refused once, not fetched again.

On a shared cluster the command touches its own application only, named after this machine
and port, with no HTTP route; stopping it deletes that application and nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
from collections.abc import Mapping
from typing import Any

from ray import serve

from pipeline.serving.front_door import build_app
from pipeline.serving.http_server import run_server
from pipeline.serving.registered import ServedModel, ServeError, load_served_model
from pipeline.settings import ServeConfig
from sat_model.caption_request import PreparedRequest, RequestError

__all__ = ["CaptionModel", "application", "run"]

_logger = logging.getLogger(__name__)


# a request in flight is at most a batch; shutting down waits for it, not Serve's default 20 s
_GRACE: dict[str, Any] = {"graceful_shutdown_timeout_s": 5.0, "graceful_shutdown_wait_loop_s": 0.5}


@serve.deployment(**_GRACE)
class CaptionModel:
    """The model: rows in (checked by the front door), rows or the reason a request is refused
    out."""

    def __init__(self, model_uri: str, tracking_uri: str, serve_cfg: ServeConfig) -> None:
        self.uri, self.tracking_uri = model_uri, tracking_uri
        self.serve = serve_cfg
        self.served: ServedModel = load_served_model(model_uri, tracking_uri, self.serve)
        self.refused: str | None = None  # the version that last failed its check
        batch: Any = self.caption_batch  # @serve.batch's handler, with its setters
        batch.set_max_batch_size(self.serve.ray.max_batch_size)
        batch.set_batch_wait_timeout_s(self.serve.ray.batch_wait_timeout_s)
        if self.serve.ray.reload_interval_s > 0 and "@" in model_uri:
            # Serve runs a replica's constructor on its event loop
            self._watch = asyncio.get_running_loop().create_task(self._follow_alias())

    async def caption(
        self, values: list[Any], params: dict[str, Any]
    ) -> list[dict[str, Any]] | RequestError:
        """One request's rows, captioned in a batch with the requests that arrive with it."""
        answer: list[dict[str, Any]] | RequestError = await self.caption_batch((values, params))
        return answer

    def describe(self) -> dict[str, Any]:
        """What ``GET /version`` answers: the version this replica serves now."""
        return self.served.describe()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def caption_batch(
        self, requests: list[tuple[list[Any], dict[str, Any]]]
    ) -> list[list[dict[str, Any]] | RequestError]:
        service = self.served.service  # one model for the whole batch, even across a reload

        def work() -> list[list[dict[str, Any]] | RequestError]:
            prepared: list[PreparedRequest | RequestError] = []
            for values, params in requests:
                try:
                    beam, attention = params.get("beam_size"), bool(params.get("return_attention"))
                    prepared.append(service.prepare(values, beam, attention))
                except RequestError as e:
                    prepared.append(e)
            ready = [p for p in prepared if isinstance(p, PreparedRequest)]
            answers = iter(service.caption_prepared(ready))
            return [p if isinstance(p, RequestError) else next(answers) for p in prepared]

        return await asyncio.get_running_loop().run_in_executor(None, work)

    def __del__(self) -> None:  # Serve's shutdown of a replica waits for its tasks
        if hasattr(self, "_watch"):
            self._watch.cancel()

    async def _follow_alias(self) -> None:
        while True:
            await asyncio.sleep(self.serve.ray.reload_interval_s)
            try:
                served = await asyncio.get_running_loop().run_in_executor(None, self._reload)
            except ServeError as e:  # a version that does not check out: said once, not retried
                _logger.error("%s; serving version %s", e, self.served.version)
                continue
            except Exception:  # a registry that is down
                _logger.exception("could not look at %s; serving the version loaded", self.uri)
                continue
            if served is not None:
                self.served = served
                _logger.warning("%s is now version %s", self.uri, served.version)

    def _reload(self) -> ServedModel | None:
        """The alias's version when it moved to one not refused before (loaded and checked),
        else None."""
        from mlflow import MlflowClient

        name, alias = self.uri.removeprefix("models:/").split("@", 1)
        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        version = client.get_model_version_by_alias(name, alias).version
        if version in (self.served.version, self.refused):
            return None
        try:
            served = load_served_model(f"models:/{name}/{version}", self.tracking_uri, self.serve)
        except ServeError:
            self.refused = version
            raise
        return dataclasses.replace(served, uri=self.uri)


def _front_door(serve_cfg: ServeConfig) -> ServeConfig:
    """The front door's limits: two batches' worth of predictions in flight per replica, so
    that the next batch fills while one is captioned; more wait their turn in the front door,
    never in Serve's router, whose queue has no bound."""
    ray_cfg = serve_cfg.ray
    turns = ray_cfg.max_replicas * ray_cfg.max_batch_size * 2
    return serve_cfg.model_copy(update={"max_concurrent_requests": turns})


def application(model_uri: str, tracking_uri: str, serve_cfg: ServeConfig) -> Any:
    """The bound Serve application: a replica takes the two batches the front door sends it."""
    ray_cfg = serve_cfg.ray
    return CaptionModel.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": ray_cfg.num_cpus},
        autoscaling_config={
            "min_replicas": ray_cfg.min_replicas,
            "max_replicas": ray_cfg.max_replicas,
            "target_ongoing_requests": ray_cfg.target_ongoing_requests,
        },
        max_ongoing_requests=ray_cfg.max_batch_size * 2,
    ).bind(model_uri, tracking_uri, serve_cfg)


def app_name(port: int) -> str:
    """This server's Serve application: one per machine and port, so a restart replaces its
    own and no one else's."""
    return f"sat-{socket.gethostname()}-{port}"


def run(model_uri: str, tracking_uri: str, serve_cfg: ServeConfig, host: str, port: int) -> None:
    """Deploy on the connected Ray and serve through the front door until SIGINT or SIGTERM;
    then delete this application (and only it)."""
    name = app_name(port)
    serve.start(proxy_location="Disabled")  # Serve already running: its settings stay
    handle = serve.run(
        application(model_uri, tracking_uri, serve_cfg), name=name, route_prefix=None
    )
    # uvicorn raises the signal that stopped it again once it is down: SIGTERM then ends this
    # function as Ctrl-C does, through the application's deletion
    signal.signal(signal.SIGTERM, _stop)
    try:
        app = build_app(_predict(handle), _front_door(serve_cfg), _describe(handle))
        run_server(app, host, port, serve_cfg.read_timeout_s)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(name)


def _stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: shutting down takes seconds
    raise KeyboardInterrupt


def _predict(handle: Any) -> Any:
    async def predict(values: list[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        answer = await handle.caption.remote(values, dict(params))
        if isinstance(answer, RequestError):
            raise answer
        return list(answer)

    return predict


def _describe(handle: Any) -> Any:
    async def describe() -> Mapping[str, Any]:
        return dict(await handle.describe.remote())

    return describe
