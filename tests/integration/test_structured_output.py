"""Structured output on the real server through the openai client: every answer to a json_schema request parses and
validates against its schema (greedy and sampled), json_object gives a JSON object, and tool_choice required or a
named function gives parsable tool_calls."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 130}},
               "required": ["name", "age"], "additionalProperties": False},
    "colours": {"type": "object", "properties": {"colours": {"type": "array", "minItems": 2, "maxItems": 4,
                                                             "items": {"enum": ["red", "green", "blue", "yellow"]}}},
                "required": ["colours"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {"answer": {"type": "boolean"},
                                                "why": {"type": "string", "maxLength": 40}},
               "required": ["answer", "why"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "population"], "additionalProperties": False}},
               "required": ["city"], "additionalProperties": False},
}
QUESTIONS = {"person": "Invent a person.", "colours": "Name some colours.", "answer": "Is the sky blue?",
             "nested": "Describe a city."}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, max_tokens=96, messages=[{"role": "user", "content": content}],
                                          **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_every_json_schema_answer_validates(client, name, sampling):
    out = ask(client, QUESTIONS[name], response_format={"type": "json_schema", "json_schema": {
        "name": name, "schema": SCHEMAS[name], "strict": True}}, **sampling)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object(client):
    out = client.chat.completions.create(model=MODEL, max_tokens=400, temperature=0, response_format={
        "type": "json_object"}, messages=[{"role": "user", "content": "Give the name and age of a dog as JSON."}])
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_required_tool_choice_returns_a_parsable_call(client):
    """One call (parallel_tool_calls false): this small model, given the array form, sometimes repeats its call
    until max_tokens (each repeat is valid, the array never closes)."""
    out = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0,
              parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message.content
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_named_function_streams_its_call(client):
    stream = ask(client, "What is the weather in Rome?", tools=[WEATHER], temperature=0, stream=True,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = [tc for chunk in stream if chunk.choices for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_a_tool_result_sent_back_gets_an_answer(client):
    """An agent's loop through the client: the call, its result as a tool message, then the model's answer."""
    first = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0,
                parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    second = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=messages,
                                            tools=[WEATHER], tool_choice="none")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=messages[:1])
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Say hello."])
def test_auto_tool_choice_answers_in_text_or_with_a_valid_call(client, question):
    out = ask(client, question, tools=[WEATHER], temperature=0, parallel_tool_calls=False)
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert choice.message.content and not choice.message.content.startswith("<") and not choice.message.tool_calls
