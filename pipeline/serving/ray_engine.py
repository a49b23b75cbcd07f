"""``sat serve --engine ray``: the champion on Ray Serve, behind the same front door.

One deployment, ``CaptionModel``, is both the ingress and the model: each replica runs the front
door of :mod:`pipeline.serving.front_door` (the same checks, requests and answers as
``sat serve``) over a model loaded from the registry with the installed code and checked against
its recorded sha256 (:mod:`pipeline.serving.registered`). Concurrent requests meet in
``@serve.batch`` and are captioned together, their images sharing one batched beam search; a
request's body never leaves the replica that read it. Replicas scale between
``serve.ray.min_replicas`` and ``max_replicas`` on the requests in flight. Every
``serve.ray.reload_interval_s`` each replica looks at the alias it serves (``@champion``); when
``sat promote`` has moved it, the replica loads the new version and serves it from then on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

from ray import serve

from pipeline.serving.front_door import build_app
from pipeline.serving.registered import ServedModel, load_served_model
from sat_model.caption_request import PreparedRequest, RequestError
from sat_model.config import ServeConfig

__all__ = ["CaptionModel", "application", "run"]

_logger = logging.getLogger(__name__)


# a request in flight is at most a batch; shutting down waits for it, not Serve's default 20 s
_GRACE: dict[str, Any] = {"graceful_shutdown_timeout_s": 5.0, "graceful_shutdown_wait_loop_s": 0.5}


@serve.deployment(**_GRACE)
@serve.ingress()
class CaptionModel:
    """The front door and the model: requests in, rows (or the reason a request is refused)
    out."""

    def __init__(self, model_uri: str, tracking_uri: str, serve_cfg: ServeConfig) -> None:
        self.uri, self.tracking_uri = model_uri, tracking_uri
        self.serve = serve_cfg
        self.served: ServedModel = load_served_model(model_uri, tracking_uri, self.serve)
        batch: Any = self.caption_batch  # @serve.batch's handler, with its setters
        batch.set_max_batch_size(self.serve.ray.max_batch_size)
        batch.set_batch_wait_timeout_s(self.serve.ray.batch_wait_timeout_s)
        if self.serve.ray.reload_interval_s > 0 and "@" in model_uri:
            # Serve runs a replica's constructor on its event loop
            self._watch = asyncio.get_running_loop().create_task(self._follow_alias())

    def __serve_build_asgi_app__(self) -> Any:
        async def predict(values: list[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            answer = await self.caption_batch((values, dict(params)))
            if isinstance(answer, RequestError):
                raise answer
            return answer

        async def describe() -> Mapping[str, Any]:
            return self.served.describe()

        return build_app(predict, _front_door(self.serve), describe)

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
            except Exception:  # a registry that is down, a version that does not check out
                _logger.exception("could not look at %s; serving the version loaded", self.uri)
                continue
            if served is not None:
                self.served = served
                _logger.warning("%s is now version %s", self.uri, served.version)

    def _reload(self) -> ServedModel | None:
        """The alias's version when it moved (loaded and checked), else None."""
        from mlflow import MlflowClient

        name, alias = self.uri.removeprefix("models:/").split("@", 1)
        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        if client.get_model_version_by_alias(name, alias).version == self.served.version:
            return None
        return load_served_model(self.uri, self.tracking_uri, self.serve)


def _front_door(serve_cfg: ServeConfig) -> ServeConfig:
    """A replica's front-door limits: two batches' worth of predictions in flight, so that the
    next batch fills while one is captioned."""
    return serve_cfg.model_copy(
        update={"max_concurrent_requests": serve_cfg.ray.max_batch_size * 2}
    )


def application(model_uri: str, tracking_uri: str, serve_cfg: ServeConfig) -> Any:
    """The bound Serve application. Serve hands a replica up to ``serve.max_queued_requests``
    requests at once, so that its front door, not Serve's queue, admits and refuses them."""
    ray_cfg = serve_cfg.ray
    return CaptionModel.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": ray_cfg.num_cpus},
        autoscaling_config={
            "min_replicas": ray_cfg.min_replicas,
            "max_replicas": ray_cfg.max_replicas,
            "target_ongoing_requests": ray_cfg.target_ongoing_requests,
        },
        max_ongoing_requests=serve_cfg.max_queued_requests,
    ).bind(model_uri, tracking_uri, serve_cfg)


def run(model_uri: str, tracking_uri: str, serve_cfg: ServeConfig, host: str, port: int) -> None:
    """Deploy on the connected Ray and serve until SIGINT or SIGTERM; then shut Serve down."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(model_uri, tracking_uri, serve_cfg), name="sat", route_prefix="/")
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()


def _stop(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: shutting down takes seconds
    raise KeyboardInterrupt  # SIGTERM ends the server as Ctrl-C does
