"""The front door of a served model: what an HTTP request must be before the model sees it.

An ASGI application (Starlette) for any engine that captions rows: ``POST /invocations`` takes
the JSON of MLflow's scoring protocol (``dataframe_split``, ``dataframe_records``, ``inputs`` or
``instances``, with optional ``params``) and answers ``{"predictions": [{"caption", "error"},
...]}``, so a client of MLflow's scoring server does not change; ``GET /ping`` and ``/health``
answer while the server lives. In order, before any image is decoded:

1. only ``application/json`` (415 otherwise: CSV, Parquet or anything else is never parsed);
2. at most ``serve.max_queued_requests`` requests admitted at once (503 with ``Retry-After``
   before the body is read), so memory is bounded whatever the clients do;
3. the body read as a stream and refused past ``serve.max_request_bytes`` (413); a body that
   stalls for ``serve.read_timeout_s``, comes slower than ``serve.min_body_rate`` or is not
   complete within ``serve.body_timeout_s`` answered 408 (:class:`_BodyClock`);
4. its commas and brackets counted against ``serve.max_rows``, then the JSON parsed, its rows
   and params checked (400 with a reason);
5. a turn among ``serve.max_concurrent_requests`` predictions in flight, waited for in order of
   arrival up to ``serve.queue_timeout_s`` (then 503 with ``Retry-After``).

Every error is ``{"error_code", "message"}``: a short reason, never a traceback, never an echo of
the body. ``predict`` is the engine's: a worker thread of this process (``sat serve``), or a call
to the model's Ray Serve deployment (``sat serve --engine ray``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.settings import ServeConfig
from sat_model.caption_request import RequestError

__all__ = ["Predict", "RequestLimits", "build_app", "parse_body", "rows_of"]

# rows in, one {"caption", "error"[, "attention"]} per row out; RequestError refuses the request
Predict = Callable[[list[Any], Mapping[str, Any]], Awaitable[list[dict[str, Any]]]]
# what GET /version answers: the model served now
Describe = Callable[[], Awaitable[Mapping[str, Any]]]
PARAMS = ("beam_size", "return_attention")
_INVOCATIONS = "/invocations"
# a refused body is read and dropped up to this size before the answer; past it, the connection
# is closed (its client sees a reset, not the reason)
_DRAIN_BYTES = 64 * 2**20
# commas, brackets and braces one row may take (its record or list, a data: URL's comma, its
# separator, a few columns), and those of the document around the rows
_VALUES_PER_ROW = 8
_VALUES_OVERHEAD = 64
_logger = logging.getLogger(__name__)


def _error(status: int, code: str, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error_code": code, "message": message}, status, headers=headers)


class _Refused(Exception):
    """A request answered before the application: ``drain`` when the client may still be
    sending a body it should finish first."""

    def __init__(self, response: Response, *, drain: bool = True) -> None:
        self.response = response
        self.drain = drain


class _BodyClock:
    """When a body being read must have arrived: within ``serve.body_timeout_s`` of its head,
    and at ``serve.min_body_rate`` on average after a first second; no single wait longer than
    ``serve.read_timeout_s``. A client that trickles bytes cannot hold its admission slot."""

    GRACE_S = 1.0  # a body's first bytes follow its head within a round trip or two

    def __init__(self, serve: ServeConfig) -> None:
        self.serve = serve
        self.start = asyncio.get_running_loop().time()
        self.received = 0  # body bytes so far

    def wait_s(self) -> float:
        """How long the next chunk may take (0: it is too late already)."""
        rate_s = self.GRACE_S + self.received / self.serve.min_body_rate
        deadline = self.start + min(self.serve.body_timeout_s, rate_s)
        left = deadline - asyncio.get_running_loop().time()
        return max(0.0, min(self.serve.read_timeout_s, left))

    async def next(self, receive: Receive) -> Message | None:
        """The next message, or None when it did not come in time."""
        try:
            message = await asyncio.wait_for(receive(), self.wait_s())
        except TimeoutError:
            return None
        self.received += len(message.get("body", b""))
        return message


class RequestLimits:
    """ASGI middleware: content type, admission and a bounded, timed body read, in that order,
    before the application runs; the application then gets the body already read."""

    def __init__(self, app: ASGIApp, serve: ServeConfig) -> None:
        self.app = app
        self.serve = serve
        self.admitted = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != _INVOCATIONS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        clock = _BodyClock(self.serve)
        try:
            self._check_head(scope)
            if self.admitted >= self.serve.max_queued_requests:
                raise _Refused(_error(503, "BUSY", "the server is busy; retry shortly", 1))
            self.admitted += 1
            try:
                body = await self._read_body(clock, receive)
            except BaseException:
                self.admitted -= 1  # draining a refused body holds no slot
                raise
        except _Refused as refused:
            if refused.drain:
                await self._drain(clock, receive)
            await refused.response(scope, receive, send)
            return
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.admitted -= 1

    async def _drain(self, clock: _BodyClock, receive: Receive) -> None:
        """Read and drop the rest of a refused body (up to :data:`_DRAIN_BYTES`, at the body's
        own pace and deadline) before answering: a client that is still writing when the server
        closes sees a broken pipe, not the reason."""
        limit = clock.received + _DRAIN_BYTES
        while clock.received <= limit:
            message = await clock.next(receive)
            if message is None or message["type"] != "http.request":
                return
            if not message.get("more_body", False):
                return

    def _check_head(self, scope: Scope) -> None:
        headers = {k.lower(): v for k, v in scope["headers"]}
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            shown = media_type.decode("latin-1")[:60] or "none"
            raise _Refused(
                _error(415, "UNSUPPORTED_MEDIA_TYPE", f"send application/json, not {shown}")
            )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise _Refused(self._too_large(int(declared)))

    @property
    def max_bytes(self) -> int:
        return self.serve.max_request_bytes

    def _too_large(self, size: int) -> Response:
        return _error(
            413,
            "REQUEST_TOO_LARGE",
            f"request too large: {'at least ' if size > self.max_bytes else ''}{size} bytes, "
            f"serve.max_request_bytes is {self.max_bytes}; split the request",
        )

    async def _read_body(self, clock: _BodyClock, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        while True:
            message = await clock.next(receive)
            if message is None:
                raise _Refused(_too_slow(self.serve), drain=False)
            if message["type"] == "http.disconnect":
                raise _Refused(Response(status_code=400), drain=False)  # nobody is left to read it
            if clock.received > self.max_bytes:
                raise _Refused(self._too_large(clock.received))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_slow(serve: ServeConfig) -> Response:
    return _error(
        408,
        "REQUEST_TIMEOUT",
        f"the request body arrived too slowly (serve.read_timeout_s {serve.read_timeout_s:g}, "
        f"serve.min_body_rate {serve.min_body_rate} bytes/s, serve.body_timeout_s "
        f"{serve.body_timeout_s:g})",
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def parse_body(body: bytes, max_rows: int) -> Any:
    """The JSON document of a body; :class:`RequestError` for one that is not JSON or holds more
    values than ``max_rows`` rows can need. Its commas and brackets are counted before it is
    parsed (none occur in base64), so a small body of millions of empty rows or of a deep
    nesting is refused in one pass over its bytes, never grown into millions of objects."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("the body is not UTF-8 text") from None
    found = text.count(",") + text.count("[") + text.count("{")
    bound = _VALUES_PER_ROW * max_rows + _VALUES_OVERHEAD
    if found > bound:
        raise RequestError(
            f"too many rows: the body holds {found} JSON commas and brackets, serve.max_rows is "
            f"{max_rows} (at most {bound} of them)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:  # its position, never its content
        raise RequestError(f"the body is not JSON: {e.msg} at byte {e.pos}") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, say
        raise RequestError(f"the body is not JSON this server reads: {str(e)[:80]}") from None


def rows_of(doc: Any) -> tuple[list[Any], dict[str, Any]]:
    """The image values and params of a request in MLflow's scoring JSON, checked for shape
    (not content: the model decodes each value and names a bad one by its row)."""
    if not isinstance(doc, dict):
        raise RequestError("the body must be a JSON object")
    params = doc.get("params") or {}
    if not isinstance(params, dict):
        raise RequestError("params must be a JSON object")
    unknown = sorted(str(k)[:40] for k in set(params) - set(PARAMS))
    if unknown:
        raise RequestError(f"unknown params {unknown[:5]}; accepted: {list(PARAMS)}")
    if not isinstance(params.get("return_attention", False), bool):
        raise RequestError("return_attention must be true or false")
    keys = [k for k in ("dataframe_split", "dataframe_records", "inputs", "instances") if k in doc]
    if len(keys) != 1:
        raise RequestError(
            "the body needs exactly one of dataframe_split, dataframe_records, inputs, instances"
        )
    return _values(keys[0], doc[keys[0]]), params


def _values(key: str, data: Any) -> list[Any]:
    if key == "dataframe_split":
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise RequestError('dataframe_split needs "columns" and "data" lists')
        columns = data.get("columns", ["image"])
        if not isinstance(columns, list) or "image" not in columns:
            raise RequestError('dataframe_split needs a column "image"')
        at = columns.index("image")
        rows = data["data"]
        if not all(isinstance(r, list) and len(r) == len(columns) for r in rows):
            raise RequestError(f"each dataframe_split row must be a list of {len(columns)}")
        return [r[at] for r in rows]
    if isinstance(data, dict):  # {"image": [...]}
        data = data.get("image")
        data = data if isinstance(data, list) else [data]
    if not isinstance(data, list):
        raise RequestError(f"{key} must be a list of images or of {{'image': ...}} records")
    if key == "dataframe_records" or any(isinstance(r, dict) for r in data):
        if not all(isinstance(r, dict) and "image" in r for r in data):
            raise RequestError(f'each {key} record needs a field "image"')
        return [r["image"] for r in data]
    return data


class _Busy(Exception):
    """No turn came within ``serve.queue_timeout_s``."""


class _Turns:
    """Predictions in flight: at most ``limit`` at once, the rest wait in order of arrival."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.semaphore = asyncio.Semaphore(limit)  # wakes its waiters first come, first served
        self.timeout_s = timeout_s

    async def run(self, work: Callable[[], Awaitable[Any]]) -> Any:
        try:
            await asyncio.wait_for(self.semaphore.acquire(), self.timeout_s)
        except TimeoutError:
            raise _Busy from None
        try:
            return await work()
        finally:
            self.semaphore.release()


def build_app(predict: Predict, serve: ServeConfig, describe: Describe) -> ASGIApp:
    """The served application: ``predict`` behind the checks above; ``describe`` says what
    ``GET /version`` answers (which model, decoded how)."""
    turns = _Turns(serve.max_concurrent_requests, serve.queue_timeout_s)

    async def invocations(request: Request) -> Response:
        try:
            doc = parse_body(await request.body(), serve.max_rows)
            values, params = rows_of(doc)
            rows = await turns.run(lambda: predict(values, params))
        except RequestError as e:
            return _error(400, "BAD_REQUEST", str(e)[:2000])
        except _Busy:
            return _error(503, "BUSY", "the server is busy; retry shortly", 5)
        except Exception:  # a bug or an exhausted machine: the client learns no server detail
            _logger.exception("captioning failed")
            return _error(500, "INTERNAL_ERROR", "internal error; the server log has the details")
        return JSONResponse({"predictions": rows})

    async def ping(request: Request) -> Response:
        return Response("\n", media_type="text/plain")

    async def version(request: Request) -> Response:
        return JSONResponse(dict(await describe()))

    app = Starlette(
        routes=[
            Route(_INVOCATIONS, invocations, methods=["POST"]),
            Route("/ping", ping, methods=["GET"]),
            Route("/health", ping, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
        ]
    )
    return RequestLimits(app, serve)
