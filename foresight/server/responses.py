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
from .lifetime import guarded, merged
from .logprobs import ChoiceLogprobs
from .serving import Piece, RequestRunner, SpecTally, sse

log = logging.getLogger("foresight.server")


@dataclass
class Job:
    runner: RequestRunner
    body: object  # CompletionRequest | ChatCompletionRequest
    requests: list[GenerateRequest]  # one per choice (`n`)
    chat: bool
    rid: str  # the response id; also the engine's request id (of choice 0), so logs of both sides match
    deadline: float | None = None  # loop.time() after which the request is stopped
    timeout_s: float = 0.0
    idle_s: float | None = None  # the longest wait for the next output

    def events(self, disconnected: Callable[[], Awaitable[bool]] | None = None):
        """(choice index, Piece) as the choices' outputs come."""
        stop = self.body.stop_list()
        return guarded(merged([self.runner.events(r, stop) for r in self.requests]), self.deadline, disconnected,
                       idle_s=self.idle_s)

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.runner.model_name}

    def choices(self) -> list["Choice"]:
        return [Choice(self, i) for i in range(len(self.requests))]

    def usage(self, choices: list["Choice"]) -> dict:
        """The prompt once, the choices' completions summed (OpenAI's usage of n choices)."""
        done = [c.last for c in choices if c.last is not None]
        return self.runner.usage(len(self.requests[0].prompt_ids), sum(p.n_completion for p in done),
                                 SpecTally.combined([p.tally for p in done]))


class Choice:
    """One choice of a response as its engine outputs (`Piece`s) arrive."""

    def __init__(self, job: Job, index: int):
        self.job = job
        self.index = index
        self.request = job.requests[index]
        sampling = self.request.sampling
        wants = sampling.logprobs is not None or sampling.prompt_logprobs is not None
        self.logprobs = ChoiceLogprobs(job.runner.token_texts, job.chat) if wants else None
        self.echo = not job.chat and bool(job.body.echo)
        self.last: Piece | None = None
        self.texts: list[str] = []
        self.reason: str | None = None

    def add(self, piece: Piece) -> list[tuple[str, str | None, dict | None]]:
        """(text, finish reason, logprobs) of what `piece` adds: completions' echoed prompt first (with its
        logprobs, which come with the first piece), then the piece's own."""
        parts = []
        if self.last is None and self.echo:
            text = self.job.runner.echo_text(self.job.body, self.request.prompt_ids)
            lp = self.logprobs.add(self.request.prompt_ids, piece.output.prompt_logprobs, prompt=True) \
                if self.logprobs is not None else None
            parts.append((text, None, lp))
        lp = self.logprobs.add(piece.output.token_ids, piece.output.logprobs) \
            if self.logprobs is not None and self.request.sampling.logprobs is not None else None
        parts.append((piece.text, piece.reason, lp))
        self.last = piece
        self.texts += [text for text, _, _ in parts]
        self.reason = piece.reason or self.reason
        return parts

    def chunk(self, text: str | None, reason: str | None, logprobs: dict | None, first: bool) -> dict:
        if self.job.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": self.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return {"index": self.index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}

    def whole(self) -> dict:
        text = "".join(self.texts)
        logprobs = self.logprobs.whole() if self.logprobs is not None else None
        if self.job.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text},
                    "finish_reason": self.reason, "logprobs": logprobs}
        return {"index": self.index, "text": text, "finish_reason": self.reason, "logprobs": logprobs}


async def stream(job: Job):
    base = job.base(chunk=True)
    choices = job.choices()
    try:
        async for i, piece in job.events():
            choice = choices[i]
            first = choice.last is None
            for text, reason, logprobs in choice.add(piece):
                if not text and reason is None and logprobs is None and not first:
                    continue
                yield sse({**base, "choices": [choice.chunk(text, reason, logprobs, first)]})
                first = False
    except Exception as exc:  # the status line went out already: the error travels as an event
        _, body = failure_body(exc, job.rid, job.timeout_s)
        yield sse(body)
        yield sse("[DONE]")
        return
    if job.body.include_usage():
        yield sse({**base, "choices": [], "usage": job.usage(choices)})
    yield sse("[DONE]")


async def complete(job: Job, disconnected: Callable[[], Awaitable[bool]]):
    choices = job.choices()
    try:
        async for i, piece in job.events(disconnected):
            choices[i].add(piece)
    except ClientGone:
        log.info("request %s: the client disconnected; the request was aborted", job.rid)
        return Response(status_code=499)  # nobody reads it
    except Exception as exc:
        status, body = failure_body(exc, job.rid, job.timeout_s)
        return AsciiJSONResponse(body, status)
    return {**job.base(chunk=False), "choices": [c.whole() for c in choices], "usage": job.usage(choices)}
