"""Pure ASGI guards in front of the app: the API key, then the request body's size and time.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that a refused request is answered before its body
is read, and so that the app's own `receive` (which reports a client's disconnect) is passed through.
"""
from __future__ import annotations

import asyncio
import hmac
import json

from .openai_schemas import error_body


async def _send_error(send, status: int, message: str, type_: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(message, type_, None, status)).encode()  # ASCII: no client text in it
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on /v1/*; /health and /metrics stay open for probes and scrapers."""

    def __init__(self, app, api_key: str, prefix: str = "/v1"):
        self.app = app
        self.key = api_key.encode()
        self.prefix = prefix

    def _protected(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")

    def _authorized(self, scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._protected(scope["path"]) and not self._authorized(scope):
            await _send_error(send, 401, "a valid API key is required: send the header "
                              "'Authorization: Bearer <key>'", "authentication_error",
                              [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413, from Content-Length or while reading a chunked body, and
    bodies that take longer than `timeout_s` to arrive with 408 (a slow client holds a connection).

    The body is read here (at most `max_bytes` of it) and replayed to the app in one message; after
    that the app's `receive` is the server's again, so disconnects still reach it.
    """

    def __init__(self, app, max_bytes: int, metrics=None, timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.timeout_s = timeout_s

    def _declared_too_large(self, scope) -> bool:
        length = _header(scope, b"content-length")
        try:
            return length is not None and int(length) > self.max_bytes
        except ValueError:
            return False  # the server rejects a malformed length itself; the count below still applies

    async def _refuse(self, send, status: int, message: str) -> None:
        if self.metrics is not None:
            self.metrics.record_failure("bad_request")
        await _send_error(send, status, message, "invalid_request_error", [(b"connection", b"close")])

    async def _too_large(self, send) -> None:
        await self._refuse(send, 413, f"the request body is larger than this server accepts "
                           f"({self.max_bytes} bytes, --max-request-bytes)")

    async def _too_slow(self, send) -> None:
        await self._refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s "
                           f"(--body-timeout)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_too_large(scope):
            await self._too_large(send)
            return
        chunks, size = [], 0
        deadline = None if self.timeout_s is None else asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await self._too_slow(send)
                return
            if message["type"] != "http.request":  # the client left before sending it all
                pending = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
