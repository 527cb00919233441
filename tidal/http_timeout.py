"""uvicorn's h11 protocol with a request read timeout, against slowloris clients.

uvicorn (0.54 checked) bounds only idle keep-alive connections (`timeout_keep_alive`,
armed after a response): a client that opens a connection and sends nothing, or sends
its request head a byte every few seconds, holds the socket forever. This protocol gives
every request `read_timeout_s` to arrive whole (head and body), counted from the moment
the connection opened or the previous response ended, and closes the connection if it
does not. A response being sent is never cut: the request was read by then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 20.0
_READING = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is incomplete


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    _read_deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in _READING:
            self._cancel_read_deadline()  # the whole request is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state in _READING:
            self._arm_read_deadline()  # the next request on this connection

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        self._cancel_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._on_read_timeout)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in _READING and not self.transport.is_closing():
            logger.info("closing %s: no whole request within %.0fs", self.client, self.read_timeout_s)
            self.transport.close()


def h11_with_read_timeout(seconds: float) -> type[ReadTimeoutH11Protocol]:
    """The protocol class to pass as uvicorn's `http=`."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": float(seconds)})
