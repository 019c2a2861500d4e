"""Connections that send their request too slowly are closed.

uvicorn times out an idle kept-alive connection, but not one that trickles its headers in (any byte resets
nothing it watches), so a few thousand slow clients would hold as many file descriptors for as long as they
like. `header_timeout_protocol` gives each connection `timeout_s` from its opening (or from its previous
response) to finish a request's headers; then it gets 408 and is closed (closed without a word where it sent
nothing: a 408 on an idle kept-alive connection could be read as the answer to the client's next request).
The body has its own limit, applied where it is read (middleware.BodyLimit).
"""
from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from .openai_schemas import error_body

log = logging.getLogger("foresight.server")


def timeout_response(message: str) -> bytes:
    """A complete HTTP/1.1 408 with an OpenAI-shaped body, for a connection about to be closed."""
    body = json.dumps(error_body(message, "invalid_request_error", None, 408)).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on every request's headers."""
    message = f"the request's headers did not arrive within {timeout_s:g} s (--header-timeout)"

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on a kept-alive connection gets the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            if self._waiting_for_headers() and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout_s, self._expire, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self, cycle_when_armed) -> None:
            # A new cycle means the headers arrived (its body has its own limit).
            if self.cycle is not cycle_when_armed or self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:  # part of a request came: say why it is cut off
                log.info("closing a connection from %s: %s", self.client, message)
                self.transport.write(timeout_response(message))
            self.transport.close()  # nothing came: an idle connection, closed without a stray response

    return HeaderTimeoutProtocol
