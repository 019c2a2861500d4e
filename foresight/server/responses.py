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
from .choice import Choice
from .lifetime import guarded, merged
from .logprobs import ChoiceLogprobs
from .serving import RequestRunner, SpecTally, sse
from .structured import Structure

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
    structure: Structure = Structure()  # response_format / tools: what the output is (structured.py)

    def events(self, disconnected: Callable[[], Awaitable[bool]] | None = None):
        """(choice index, Piece) as the choices' outputs come."""
        stop = self.body.stop_list()
        return guarded(merged([self.runner.events(r, stop) for r in self.requests]), self.deadline, disconnected,
                       idle_s=self.idle_s)

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.runner.model_name}

    def choices(self) -> list[Choice]:
        echo = None
        if not self.chat and self.body.echo:
            echo = self.runner.echo_text(self.body, self.requests[0].prompt_ids)
        return [Choice(i, request, self.chat, self.structure, self.logprobs_of(request), echo, self.token_ids)
                for i, request in enumerate(self.requests)]

    @property
    def token_ids(self) -> bool:
        return bool(self.body.return_token_ids)

    def prompt_ids(self) -> dict:
        """return_token_ids on chat: the prompt's ids at the top of the response (or of the first chunk)."""
        return {"prompt_token_ids": list(self.requests[0].prompt_ids)} if self.chat and self.token_ids else {}

    def logprobs_of(self, request: GenerateRequest) -> ChoiceLogprobs | None:
        sampling = request.sampling
        if sampling.logprobs is None and sampling.prompt_logprobs is None:
            return None
        return ChoiceLogprobs(self.runner.token_texts, self.chat)

    def usage(self, choices: list[Choice]) -> dict:
        """The prompt once, the choices' completions summed (OpenAI's usage of n choices)."""
        done = [c.last for c in choices if c.last is not None]
        return self.runner.usage(len(self.requests[0].prompt_ids), sum(p.n_completion for p in done),
                                 SpecTally.combined([p.tally for p in done]))


async def stream(job: Job):
    base = job.base(chunk=True)
    choices = job.choices()
    first = job.prompt_ids()
    try:
        async for i, piece in job.events():
            for chunk in choices[i].stream(piece):
                yield sse({**base, **first, "choices": [chunk]})
                first = {}
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
    return {**job.base(chunk=False), **job.prompt_ids(), "choices": [c.whole() for c in choices],
            "usage": job.usage(choices)}
