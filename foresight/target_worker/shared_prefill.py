"""One prefill for requests with the same prompt: the choices of an `n` > 1 request, or the same prompt sent by
several clients at once.

When a prompt's last chunk is in, every request still waiting to start on the same prompt takes a copy of that
cache (a copy of the KV, ~9 MB for 200 tokens of the embedded default, against a forward over the whole prompt)
and the same last-position logits; each then decides its first token with its own seed, rules and grammar, as its
own prefill would have. Requests that asked for the prompt's logprobs prefill on their own.
"""
from __future__ import annotations

from .request_state import RequestState


def prefill_twins(state: RequestState, requests) -> list[RequestState]:
    """The requests among `requests` (RequestState values) that can take `state`'s prefill: the same prompt, not
    started yet, no prompt logprobs wanted by either."""
    if state.request.sampling.prompt_logprobs is not None:
        return []
    prompt = state.request.prompt_ids
    return [other for other in requests if other is not state and other.cache is None and other.prefill_pos == 0
            and other.request.sampling.prompt_logprobs is None and other.request.prompt_ids == prompt]


def take_prefill(twin: RequestState, state: RequestState, runner) -> None:
    """`twin` starts from a copy of `state`'s cache, which holds exactly their common prompt (`runner`: the target's,
    which makes the copy)."""
    twin.cache = runner.copy_cache(state.cache)
    twin.prefill_pos = state.prefill_pos
