"""uvicorn, in this process, with a deadline on every request head.

uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``), but a
socket that opens and sends nothing, or dribbles its headers, it keeps forever. The protocol
below closes such a socket once ``serve.read_timeout_s`` has passed without a complete request
head; the body's own pace is the front door's business (:mod:`pipeline.serving.front_door`).
"""

from __future__ import annotations

import asyncio
import logging

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["run_server"]


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol; a connection must complete each request head in time."""

    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _expire(self) -> None:
        # h11 is IDLE on the client's side until a whole request head has arrived
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def run_server(app: ASGIApp, host: str, port: int, read_timeout_s: float) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_HeadDeadline,
        timeout_keep_alive=max(1, round(read_timeout_s)),
        access_log=False,
        log_level=logging.WARNING,
        lifespan="off",
    )
    uvicorn.Server(config).run()
