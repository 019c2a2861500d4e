"""One admitted request's answer: an SSE stream or one JSON body, both bounded by the request's lifetime.

A streaming request ends with `data: [DONE]` whatever happens; a failure after the 200 went out is one
OpenAI-shaped `{"error": ...}` event before it (what the openai client raises as an APIError). A
non-streaming request that fails gets the error as its HTTP status (504 past --request-timeout).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from ..protocol.messages import GenerateRequest
from .errors import AsciiJSONResponse, ClientGone, failure_body
from .lifetime import guarded
from .serving import RequestRunner, sse

log = logging.getLogger("foresight.server")


@dataclass
class Job:
    runner: RequestRunner
    body: object  # CompletionRequest | ChatCompletionRequest
    request: GenerateRequest
    chat: bool
    rid: str  # the response id; also the engine's request id, so logs of both sides match
    deadline: float | None = None  # loop.time() after which the request is stopped
    timeout_s: float = 0.0
    idle_s: float | None = None  # the longest wait for the next output

    def events(self, disconnected: Callable[[], Awaitable[bool]] | None = None):
        return guarded(self.runner.events(self.request, self.body.stop_list()), self.deadline, disconnected,
                       idle_s=self.idle_s)

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.runner.model_name}


def _chunk_choice(chat: bool, text: str | None, reason: str | None, first: bool) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}


async def stream(job: Job):
    base = job.base(chunk=True)
    n_completion, tally, first = 0, None, True
    try:
        async for text, reason, tally, n_completion in job.events():
            if not text and reason is None and not first:
                continue
            yield sse({**base, "choices": [_chunk_choice(job.chat, text, reason, first)]})
            first = False
    except Exception as exc:  # the status line went out already: the error travels as an event
        _, body = failure_body(exc, job.rid, job.timeout_s)
        yield sse(body)
        yield sse("[DONE]")
        return
    if job.body.include_usage() and tally is not None:
        usage = job.runner.usage(len(job.request.prompt_ids), n_completion, tally)
        yield sse({**base, "choices": [], "usage": usage})
    yield sse("[DONE]")


async def complete(job: Job, disconnected: Callable[[], Awaitable[bool]]):
    parts, reason, tally, n_completion = [], None, None, 0
    try:
        async for text, r, tally, n_completion in job.events(disconnected):
            parts.append(text)
            reason = r or reason
    except ClientGone:
        log.info("request %s: the client disconnected; the request was aborted", job.rid)
        return Response(status_code=499)  # nobody reads it
    except Exception as exc:
        status, body = failure_body(exc, job.rid, job.timeout_s)
        return AsciiJSONResponse(body, status)
    text = "".join(parts)
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {**job.base(chunk=False), "choices": [choice],
            "usage": job.runner.usage(len(job.request.prompt_ids), n_completion, tally)}
