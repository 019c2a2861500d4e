"""OpenAI-shaped error answers, and the one place that decides what a failure tells the client.

Internal failures (a worker exception, a bug in the api) are logged with the request id and answered
with a generic message: exception text can carry paths, tensor shapes or prompt fragments of other
requests, none of which is the client's business.
"""
from __future__ import annotations

import json
import logging

from fastapi.responses import JSONResponse

from .engine_client import EngineUnavailable, QueueFull, RequestError
from .openai_schemas import error_body

log = logging.getLogger("foresight.server")

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
         504: "timeout_error"}


class RequestTimedOut(Exception):
    """The request ran past --request-timeout; it was aborted in the engine."""


class OutputStalled(RequestTimedOut):
    """No output for --idle-timeout seconds; the request was aborted in the engine."""

    def __init__(self, idle_s: float):
        super().__init__(idle_s)
        self.idle_s = idle_s


class ClientGone(Exception):
    """The client disconnected; the request was aborted in the engine."""


class AsciiJSONResponse(JSONResponse):
    """Error messages may quote what a client sent; escaped to ASCII, any text (even a lone surrogate)
    serializes, where Starlette's UTF-8 encoding would raise."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error(status: int, message: str, param: str | None = None, type_: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    body = error_body(message, type_ or KINDS.get(status, "server_error"), param, status)
    return AsciiJSONResponse(body, status, headers=headers)


def internal_message(rid: str) -> str:
    return f"internal server error (request id {rid}); the server log has the details"


def failure(exc: BaseException, rid: str, timeout_s: float = 0.0) -> tuple[int, str]:
    """(status, message for the client) of a request that failed after it was admitted."""
    if isinstance(exc, OutputStalled):
        return 504, f"the request produced no output for {exc.idle_s:g} s (the server's idle timeout) and was stopped"
    if isinstance(exc, RequestTimedOut):
        return 504, f"the request ran longer than the server's request timeout ({timeout_s:g} s) and was stopped"
    if isinstance(exc, QueueFull):
        return 429, str(exc)
    if isinstance(exc, EngineUnavailable):
        return 503, str(exc)
    if isinstance(exc, RequestError):
        if exc.status < 500 or exc.public:
            return exc.status, str(exc)  # the worker's verdict on the input, or the api's own words
        if exc.status == 503:  # a worker died; its reason may quote an exception
            log.warning("request %s failed: %s", rid, exc)
            return 503, f"a worker died while serving this request and is being restarted (request id {rid})"
        log.error("request %s failed in the target worker: %s", rid, exc)
    else:
        log.error("request %s failed", rid, exc_info=exc)
    return 500, internal_message(rid)


def failure_body(exc: BaseException, rid: str, timeout_s: float = 0.0) -> tuple[int, dict]:
    status, message = failure(exc, rid, timeout_s)
    return status, error_body(message, KINDS.get(status, "server_error"), None, status)
