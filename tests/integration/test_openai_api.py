"""A real `foresight serve` process on the embedded default, driven by the official openai client."""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_default(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 24 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_raw_stream_ends_with_done(live_server):
    body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live_server}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 2


def test_non_streaming_completion_matches_streamed_text(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert whole.choices[0].text == streamed
    assert whole.usage.completion_tokens == 12


def test_stop_string_truncates(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=["8"])
    assert "8" not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"nucleus_threshold": 0}, "nucleus_threshold"),
    ({"verification": "sometimes"}, "verification"),
    ({"n": 3}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
    # once silently ignored: refused until they are built
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"some_vendor_field": 1}, "some_vendor_field"),
]


@pytest.mark.parametrize("override,param", BAD_REQUESTS)
def test_bad_parameters_get_400_naming_the_parameter(live_server, override, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **override}
    resp = httpx.post(f"{live_server}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["param"] == "model"


def test_prompt_longer_than_context_is_400(live_server):
    max_len = httpx.get(f"{live_server}/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": list(range(10, 10 + max_len + 5)), "max_tokens": 1}
    resp = httpx.post(f"{live_server}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_malformed_json_is_400_and_server_keeps_serving(live_server, client):
    resp = httpx.post(f"{live_server}/v1/chat/completions", content=b'{"messages": [', timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(f"{live_server}/health").status_code == 200


def test_metrics_count_requests(live_server, client):
    client.completions.create(model=MODEL, prompt="one two three", max_tokens=4, temperature=0)
    text = httpx.get(f"{live_server}/metrics").text
    assert 'foresight_request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}' in text
    gen = [l for l in text.splitlines() if l.startswith("foresight_generation_tokens_total{")]
    assert gen and float(gen[0].split()[-1]) >= 4


def test_streaming_with_nucleus_verification(client, live_server):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=32,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"verification": "nucleus", "nucleus_threshold": 0.9})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    spec = chunks[-1].usage.model_extra["speculation"]
    assert spec["nucleus_extra_accepted_tokens"] >= 0 and spec["rounds"] >= 1
    # the server's default mode auto: how it ran each round, in the usage block and as a metric
    assert sum(spec["strategy_rounds"].values()) == spec["rounds"]
    assert set(spec["strategy_rounds"]) <= {"ngram", "pipelined", "hybrid"}
    metrics = httpx.get(f"{live_server}/metrics").text
    assert "foresight_nucleus_extra_accepted_tokens_total" in metrics
    counted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("foresight_strategy_rounds_total{"))
    assert counted >= spec["rounds"]


def test_oversized_body_is_413_at_once_and_server_keeps_serving(live_server, client):
    body = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'  # over the default 4 MiB
    resp = httpx.post(f"{live_server}/v1/completions", content=body, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    assert httpx.get(f"{live_server}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("raw,param", [
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}', "messages"),
    ('{"prompt": "\\ud800"}', "prompt"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
])
def test_malformed_text_and_numbers_are_400_not_500(live_server, raw, param):
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    resp = httpx.post(f"{live_server}{path}", content=raw.encode(), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_tiny_temperature_is_greedy(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6)
    tiny = client.completions.create(temperature=1e-40, **kwargs)
    assert tiny.choices[0].text == client.completions.create(temperature=0, **kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, temperature=1e-40, **kwargs)
                       if c.choices)
    assert streamed == tiny.choices[0].text


def test_logit_rules_shape_the_output(client):
    """logit_bias forces a token; a repetition penalty changes a repetitive answer (both at T=0)."""
    from transformers import AutoTokenizer

    from foresight.target_worker.loading import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(None))
    base = dict(model=MODEL, max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}])
    plain = client.chat.completions.create(**base).choices[0].message.content
    blue = tokenizer.encode(" blue", add_special_tokens=False)
    assert len(blue) == 1
    forced = client.chat.completions.create(**base, logit_bias={str(blue[0]): 100})
    assert forced.choices[0].message.content == tokenizer.decode(blue * 8) and forced.usage.completion_tokens == 8
    penalized = client.chat.completions.create(**base, extra_body={"repetition_penalty": 2.0})
    assert penalized.choices[0].message.content != plain
