"""`n` choices in the api against a fake engine: one engine request per choice, seeded seed + i, admitted together or
not at all; the choices streamed interleaved with their index, usage with the prompt once and the completions
summed; one choice failing fails the response and aborts the others."""
from __future__ import annotations

import asyncio
import json

from support.fake_engine import MODEL, FakeEngine, call, outputs_for, running_app, worker_error

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 8}


def by_choice(request) -> list:
    """Each choice's own text: the index in its request id ("...-2"), choice 0 the plain id."""
    tail = request.req_id.rsplit("-", 1)[-1]
    index = int(tail) if tail.isdigit() and len(tail) < 3 else 0
    return outputs_for(f"answer {index}", pieces=3)


def post(path: str, body: dict, engine: FakeEngine):
    async def go():
        async with running_app(engine) as app:
            return await call(app, "POST", path, body)
    return asyncio.run(go())


def test_n_choices_are_n_seeded_engine_requests():
    engine = FakeEngine(script=by_choice)
    reply = post("/v1/chat/completions", {**CHAT, "n": 3, "seed": 40, "temperature": 1.0}, engine)
    assert reply.status == 200, reply.body
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["answer 0", "answer 1", "answer 2"]
    assert [r.sampling.seed for r in engine.requests] == [40, 41, 42]
    assert len({r.req_id for r in engine.requests}) == 3 and body["id"] == engine.requests[0].req_id
    assert body["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_ids)
    assert body["usage"]["completion_tokens"] == 3 * len("answer 0")


def test_without_a_seed_each_choice_draws_its_own():
    engine = FakeEngine(script=by_choice)
    assert post("/v1/completions", {**COMPLETION, "n": 2}, engine).status == 200
    assert [r.sampling.seed for r in engine.requests] == [None, None]  # the target worker seeds each at random


def test_streamed_choices_carry_their_index_and_usage_sums_them():
    engine = FakeEngine(script=by_choice)
    reply = post("/v1/completions", {**COMPLETION, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
                 engine)
    events = [json.loads(e) for e in reply.events()[:-1]]
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "answer 0", 1: "answer 1"}
    finished = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2 * len("answer 0")


def test_one_failing_choice_fails_the_response_and_aborts_the_others():
    def script(request):
        if request.req_id.endswith("-1"):
            raise worker_error("the target failed", 500)
        return outputs_for("never finished", pieces=4)[:2]  # then hangs (until aborted)

    engine = FakeEngine(script=script, hang=True)
    reply = post("/v1/chat/completions", {**CHAT, "n": 3}, engine)
    assert reply.status == 500
    others = {r.req_id for r in engine.requests if not r.req_id.endswith("-1")}
    assert len(others) == 2 and others <= set(engine.aborted)


def test_n_out_of_range_is_400_naming_it():
    engine = FakeEngine()
    for n in (0, 17, True):
        reply = post("/v1/chat/completions", {**CHAT, "n": n}, engine)
        assert reply.status == 400 and reply.json()["error"]["param"] == "n"
    assert engine.requests == []


def test_n_with_logprobs_and_echo_gives_each_choice_its_own():
    engine = FakeEngine(script=by_choice)
    body = post("/v1/completions", {**COMPLETION, "prompt": "ab", "n": 2, "echo": True, "logprobs": 0}, engine).json()
    for i, choice in enumerate(body["choices"]):
        assert choice["text"] == f"abanswer {i}"
        assert choice["logprobs"]["tokens"] == list(f"abanswer {i}")
        assert choice["logprobs"]["token_logprobs"][0] is None


class ThirdNotAdmitted(FakeEngine):
    """Admits two requests, then the queue is full; records what is given back."""

    def __init__(self):
        super().__init__()
        self.admitted, self.discarded = [], []

    def admit(self, request):
        from foresight.server.engine_client import QueueFull

        if len(self.admitted) == 2:
            raise QueueFull("too many requests waiting")
        self.admitted.append(request.req_id)

    def discard(self, req_id):
        self.discarded.append(req_id)


def test_choices_are_admitted_together_or_not_at_all():
    engine = ThirdNotAdmitted()
    reply = post("/v1/chat/completions", {**CHAT, "n": 3}, engine)
    assert reply.status == 429
    assert set(engine.admitted) <= set(engine.discarded) and engine.requests == []
