"""vLLM's `return_token_ids` in the api, against a fake engine: the prompt's ids (chat: on the response, completions:
on each choice) and each choice's generated ids beside the text; streamed, the prompt's in the first chunk only and
each chunk's new ids, adding up to the whole answer's; ids stop where a stop string ends the answer; absent, no
field; not a boolean, a 400 naming it."""
from __future__ import annotations

import asyncio
import json

import pytest

from support.fake_engine import MODEL, FakeEngine, call, outputs_for, running_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "return_token_ids": True}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "return_token_ids": True}
ANSWER = list(b"hello world")


def post(path: str, body: dict, engine: FakeEngine | None = None):
    async def go():
        async with running_app(engine) as app:
            return await call(app, "POST", path, body)
    return asyncio.run(go())


def events(reply) -> list[dict]:
    return [json.loads(e) for e in reply.events()[:-1]]


def test_chat_returns_the_prompts_ids_on_the_response_and_the_answers_on_its_choice():
    engine = FakeEngine()
    body = post("/v1/chat/completions", CHAT, engine).json()
    assert body["prompt_token_ids"] == engine.requests[0].prompt_ids and body["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == ANSWER
    assert bytes(body["choices"][0]["token_ids"]).decode() == body["choices"][0]["message"]["content"]


def test_completions_return_both_on_each_choice():
    choice = post("/v1/completions", COMPLETION).json()["choices"][0]
    assert choice["prompt_token_ids"] == list(b"hi") and choice["token_ids"] == ANSWER


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                       ("/v1/completions", {**COMPLETION, "echo": True, "n": 2})])
def test_streamed_ids_come_as_deltas_and_the_prompts_once(path, body):
    chunks = [e for e in events(post(path, {**body, "stream": True})) if e["choices"]]
    n = body.get("n", 1)
    for index in range(n):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert [i for c in mine for i in c.get("token_ids", [])] == ANSWER
        assert len([c for c in mine if c.get("token_ids")]) == 2  # the fake engine's two outputs
        if "chat" not in path:
            assert mine[0]["prompt_token_ids"] == list(b"hi")
            assert all("prompt_token_ids" not in c for c in mine[1:])
    if "chat" in path:
        assert "prompt_token_ids" in chunks[0] and all("prompt_token_ids" not in e for e in chunks[1:])


def test_ids_end_where_a_stop_string_ends_the_answer():
    choice = post("/v1/chat/completions", {**CHAT, "stop": [" w"]}).json()["choices"][0]
    assert choice["message"]["content"] == "hello" and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == list(b"hello w")  # up to the token that completed the stop string


def test_a_tool_calling_choice_still_reports_every_id():
    call_text = '<tool_call>[{"name": "f", "arguments": {}}]'
    # room for the tools' description: the fake tokenizer makes a token of every byte
    engine = FakeEngine(max_model_len=4096, script=lambda request: outputs_for(call_text, pieces=3, reason="stop"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {**CHAT, "max_tokens": 60, "tools": tools, "tool_choice": "auto", "stream": True}
    chunks = [e["choices"][0] for e in events(post("/v1/chat/completions", body, engine)) if e["choices"]]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert bytes(i for c in chunks for i in c.get("token_ids", [])).decode() == call_text


def test_absent_or_false_adds_nothing_and_a_non_boolean_is_refused():
    for flag in ({}, {"return_token_ids": False}, {"return_token_ids": None}):
        body = post("/v1/chat/completions", {**CHAT, **flag} if flag else {k: v for k, v in CHAT.items()
                                                                             if k != "return_token_ids"}).json()
        assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    reply = post("/v1/completions", {**COMPLETION, "return_token_ids": "yes"})
    assert reply.status == 400 and reply.json()["error"]["param"] == "return_token_ids"
