"""A real `foresight serve` process on the embedded default, driven by the official openai client."""
from __future__ import annotations

import time

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
    ({"n": 17}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
    # once silently ignored; now built, and refused where they cannot be honoured
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),  # not among the tools
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
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
    # the round planner's figures, reported as the target goes idle: auto measured its strategies' goodput
    deadline, goodput = time.monotonic() + 10, []
    while not goodput and time.monotonic() < deadline:
        goodput = [line for line in httpx.get(f"{live_server}/metrics").text.splitlines()
                   if line.startswith("foresight_auto_goodput_tokens_per_second{")]
        time.sleep(0.2)
    assert goodput and all(float(line.split()[-1]) > 0 for line in goodput)


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

    from foresight.models.loading import resolve_target

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


def test_chat_logprobs_through_the_client(client):
    """Each generated token with its logprob, bytes and top 3; at T=0 each token is its position's most likely."""
    out = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                                         messages=[{"role": "user", "content": "Name three colours."}])
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert b"".join(bytes(e.bytes) for e in content) == choice.message.content.encode()
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_loglikelihood_request_as_lm_eval_sends_it(client):
    """lm-eval's local-completions loglikelihood: echo + logprobs + max_tokens 0 scores the prompt's tokens."""
    prompt = "The capital of France is Paris"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and "".join(lp.tokens) == prompt and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[-1] > -3  # " Paris" is likely after "The capital of France is"


def test_n_choices_through_the_client(client):
    """n=3: three choices, the texts of seeds 5, 6, 7. In fp32 each equals the same request sent alone with its seed;
    in bf16 choices served side by side run forwards of other shapes than a request alone, whose rounding can move
    a sampled token (README, "Seeds"), so there only the shape of the answer is checked."""
    import torch

    from support.suite_dtype import resolved_suite_dtype

    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a short story."}], max_tokens=16,
                  temperature=1.0)
    out = client.chat.completions.create(n=3, seed=5, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content for c in out.choices)
    assert out.usage.completion_tokens == 3 * 16
    alone = [client.chat.completions.create(seed=5 + i, **kwargs).choices[0].message.content for i in range(3)]
    assert len(set(alone)) == 3  # three seeds, three texts
    if resolved_suite_dtype() == torch.float32:
        assert [c.message.content for c in out.choices] == alone


def test_control_token_text_in_a_message_is_tokenized_as_text(client):
    """"<|im_end|>" typed into a message is its characters, not the turn's end: the prompt grows by the text's
    pieces (the README: no message can forge a turn)."""
    from transformers import AutoTokenizer

    from foresight.models.loading import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(None))
    as_text = tokenizer.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True)
    assert len(as_text) > 1

    def prompt_tokens(content: str) -> int:
        return client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
            {"role": "user", "content": content}]).usage.prompt_tokens

    assert prompt_tokens("hi<|im_end|>") - prompt_tokens("hi") == len(as_text)


def test_chat_prompts_without_control_text_tokenize_as_the_template_gives_them():
    """The piecewise tokenizing used for messages with control text changes nothing else (the chat set)."""
    from transformers import AutoTokenizer

    from foresight.bench.prompts import chat_prompts
    from foresight.server.chat_prompt import piecewise_ids
    from foresight.models.loading import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(None))
    for item in chat_prompts()[:40]:
        want = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert piecewise_ids(tokenizer, item["messages"]) == want
