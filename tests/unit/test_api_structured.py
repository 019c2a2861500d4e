"""Structured output in the api against a fake engine: response_format and tools become the grammar the engine gets
(or a 400 naming the field), tools are described to the model, and a tool-calling choice comes back as OpenAI's
tool_calls (whole, and streamed as one delta), with its text when it was cut short."""
from __future__ import annotations

import asyncio
import json

import pytest

from support.fake_engine import MODEL, FakeEngine, call, outputs_for, running_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 16}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def Engine(**kw) -> FakeEngine:
    """A fake engine with room for the tools' description (the fake tokenizer makes a token of every byte)."""
    return FakeEngine(max_model_len=4096, **kw)


def post(body: dict, engine: FakeEngine):
    async def go():
        async with running_app(engine) as app:
            return await call(app, "POST", "/v1/chat/completions", body)
    return asyncio.run(go())


def says(text: str, reason: str = "stop"):
    return lambda request: outputs_for(text, pieces=3, reason=reason)


def test_json_schema_becomes_the_engines_grammar():
    engine = Engine(script=says('{"a": 1}'))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reply = post({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                    "strict": True}}}, engine)
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    grammar = json.loads(engine.requests[0].sampling.grammar)
    assert grammar["grammars"][0]["json_schema"]["properties"] == schema["properties"]
    post({**CHAT, "response_format": {"type": "text"}}, engine)
    assert engine.requests[1].sampling.grammar is None


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format"),
    ({"type": "json_schema"}, "response_format"),  # no json_schema
    ({"type": "xml"}, "response_format"),
])
def test_a_schema_the_engine_cannot_compile_is_400_naming_response_format(fmt, param):
    engine = Engine()
    reply = post({**CHAT, "response_format": fmt}, engine)
    assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body
    assert engine.requests == []


def test_required_tool_choice_returns_tool_calls_and_describes_the_tools():
    engine = Engine(script=says('[{"name": "get_weather", "arguments": {"city": "Paris"}}]'))
    reply = post({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}, engine)
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call_,) = choice["message"]["tool_calls"]
    assert call_["type"] == "function" and call_["id"].startswith("call_")
    assert call_["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    prompt = bytes(engine.requests[0].prompt_ids).decode()
    assert "get_weather" in prompt and "get_time" in prompt  # the fake tokenizer's prompt is the text itself
    grammar = json.loads(engine.requests[0].sampling.grammar)["grammars"][0]["json_schema"]
    assert grammar["type"] == "array" and grammar["minItems"] == 1


def test_a_named_function_is_called_with_its_arguments():
    engine = Engine(script=says('{"city": "Oslo"}'))
    reply = post({**CHAT, "tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}}, engine)
    (call_,) = reply.json()["choices"][0]["message"]["tool_calls"]
    assert call_["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    grammar = json.loads(engine.requests[0].sampling.grammar)["grammars"][0]["json_schema"]
    assert grammar["required"] == ["city"]
    assert "get_time" not in bytes(engine.requests[0].prompt_ids).decode()


def test_tool_calls_stream_as_one_delta_after_the_role():
    engine = Engine(script=says('[{"name": "get_time", "arguments": {}}]'))
    reply = post({**CHAT, "tools": [TIME], "tool_choice": "required", "stream": True}, engine)
    chunks = [json.loads(e)["choices"][0] for e in reply.events()[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": None}
    assert all("content" not in c["delta"] or c["delta"]["content"] is None for c in chunks)
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["index"] == 0
    assert last["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_call_cut_short_comes_back_as_text_with_finish_reason_length():
    engine = Engine(script=says('[{"name": "get_ti', reason="length"))
    choice = post({**CHAT, "tools": [TIME], "tool_choice": "required"}, engine).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == '[{"name": "get_ti'


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_tool_requests_that_cannot_be_honoured_are_400_naming_the_field(extra, param):
    engine = Engine()
    reply = post({**CHAT, **extra}, engine)
    assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body
    assert engine.requests == []


def test_tool_choice_none_neither_describes_nor_calls():
    engine = Engine(script=says("hello"))
    choice = post({**CHAT, "tools": [WEATHER], "tool_choice": "none"}, engine).json()["choices"][0]
    assert choice["message"]["content"] == "hello" and "tool_calls" not in choice["message"]
    assert engine.requests[0].sampling.grammar is None and "get_weather" not in bytes(engine.requests[0].prompt_ids).decode()


def test_a_tool_result_goes_back_to_the_model_with_the_call_it_answers():
    """The loop an agent runs: our call comes back in the assistant message, its result in a tool message; both
    reach the prompt (the call as the JSON list this server generates)."""
    engine = Engine(script=says("It is sunny in Paris."))
    call_ = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call_]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    reply = post({**CHAT, "messages": messages, "tools": [WEATHER], "tool_choice": "none"}, engine)
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["message"]["content"] == "It is sunny in Paris."
    prompt = bytes(engine.requests[0].prompt_ids).decode()
    assert '<assistant>[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in prompt
    assert '<tool>{"sky": "sunny"}' in prompt


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_tool_choice_answers_in_text_or_calls(choice):
    """tool_choice auto (also the default with tools): a text answer stays text; an answer that starts with the
    tool mark is calls. The tools are described, with the mark."""
    extra = {"tools": [WEATHER]} if choice is None else {"tools": [WEATHER], "tool_choice": choice}
    engine = Engine(script=says("It is sunny."))
    text = post({**CHAT, **extra}, engine).json()["choices"][0]
    assert text["message"]["content"] == "It is sunny." and text["finish_reason"] == "stop"
    assert "<tool_call>" in bytes(engine.requests[0].prompt_ids).decode()
    assert engine.requests[0].sampling.grammar.startswith("start: TEXT | \"<tool_call>\" calls")  # a Lark grammar
    engine = Engine(script=says('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'))
    called = post({**CHAT, **extra}, engine).json()["choices"][0]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert called["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_auto_tool_choice_streams_text_as_text_and_calls_as_a_delta():
    engine = Engine(script=says("Sunny and warm."))
    chunks = [json.loads(e)["choices"][0] for e in post({**CHAT, "tools": [WEATHER], "stream": True}, engine).events()[:-1]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Sunny and warm."
    engine = Engine(script=says('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'))
    chunks = [json.loads(e)["choices"][0] for e in post({**CHAT, "tools": [WEATHER], "stream": True}, engine).events()[:-1]]
    assert all(not c["delta"].get("content") for c in chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"]["tool_calls"][0]["index"] == 0


def test_the_auto_grammar_takes_text_or_marked_calls_and_nothing_else():
    import llguidance

    from foresight.server.structured import structure_of
    from foresight.server.openai_schemas import ChatCompletionRequest
    from foresight.target_worker.grammar import grammar_tokenizer
    from support.tiny_models import VOCAB, tiny_char_tokenizer

    tok = tiny_char_tokenizer()
    grammar = structure_of(ChatCompletionRequest(**{**CHAT, "tools": [WEATHER]})).grammar
    lt = grammar_tokenizer(tok, VOCAB, [VOCAB - 1])

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(lt, grammar)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert takes("It is sunny.")
    assert takes('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert not takes('<tool_call>[{"name": "get_time", "arguments": {}}]')  # not among the tools
    assert not takes("<b>sunny</b>")  # a text answer cannot start with "<"
