"""Logprobs in the api (server/logprobs.py) against a fake engine that reports recognisable values: OpenAI's chat and
completions shapes, streamed and not, completions' echo (with the prompt's logprobs, and max_tokens 0 to score a
prompt alone), -inf as -9999.0, and the parameters' 400s."""
from __future__ import annotations

import asyncio
import json

import pytest

from foresight.server.logprobs import IMPOSSIBLE, TokenTexts
from support.fake_engine import MODEL, ByteTokenizer, FakeEngine, call, outputs_for, running_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 8}


def post(path: str, body: dict, engine: FakeEngine | None = None):
    async def go():
        async with running_app(engine) as app:
            return await call(app, "POST", path, body)
    return asyncio.run(go())


def streamed_choices(reply) -> list[dict]:
    return [json.loads(e)["choices"][0] for e in reply.events()[:-1] if json.loads(e)["choices"]]


def test_chat_logprobs_have_openais_shape_with_each_tokens_values():
    reply = post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert "".join(e["token"] for e in content) == choice["message"]["content"] == "hello world"
    for entry, byte in zip(content, b"hello world"):
        assert entry == {"token": chr(byte), "logprob": -byte / 100, "bytes": [byte],
                         "top_logprobs": [{"token": chr(byte + j), "logprob": -(byte + j) / 100 - 0.5,
                                           "bytes": [byte + j]} for j in range(2)]}


def test_chat_logprobs_without_top_logprobs_list_no_alternatives_and_none_when_not_asked():
    content = post("/v1/chat/completions", {**CHAT, "logprobs": True}).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len("hello world") and all(e["top_logprobs"] == [] for e in content)
    assert post("/v1/chat/completions", CHAT).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1}),
                                       ("/v1/completions", {**COMPLETION, "logprobs": 1})])
def test_streamed_logprobs_add_up_to_the_whole_answers(path, body):
    whole = post(path, body).json()["choices"][0]["logprobs"]
    chunks = [c["logprobs"] for c in streamed_choices(post(path, {**body, "stream": True})) if c["logprobs"]]
    assert len(chunks) == 2  # the fake engine's two outputs
    if "chat" in path:
        assert [e for c in chunks for e in c["content"]] == whole["content"]
    else:
        assert {k: [x for c in chunks for x in c[k]] for k in whole} == whole


def test_completion_logprobs_hold_tokens_offsets_and_the_token_among_its_top():
    logprobs = post("/v1/completions", {**COMPLETION, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list("hello world")
    assert logprobs["token_logprobs"] == [-b / 100 for b in b"hello world"]
    assert logprobs["text_offset"] == list(range(len("hello world")))
    # OpenAI: up to logprobs + 1 entries, the sampled token always among them (here its own top, and one more)
    assert logprobs["top_logprobs"][0] == {"h": -ord("h") / 100 - 0.5}  # the fake's top-1 is the token itself
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])


def test_echo_puts_the_prompt_and_its_logprobs_first():
    body = {**COMPLETION, "prompt": "abc", "echo": True, "logprobs": 0}
    choice = post("/v1/completions", body).json()["choices"][0]
    assert choice["text"] == "abchello world"
    lp = choice["logprobs"]
    assert lp["tokens"][:3] == ["a", "b", "c"] and lp["token_logprobs"][:3] == [None, -ord("b") / 100, -ord("c") / 100]
    assert lp["top_logprobs"][0] is None and lp["text_offset"][:5] == [0, 1, 2, 3, 4]
    streamed = streamed_choices(post("/v1/completions", {**body, "stream": True}))
    assert "".join(c["text"] for c in streamed) == "abchello world"
    assert streamed[0]["text"] == "abc" and streamed[0]["logprobs"]["tokens"] == ["a", "b", "c"]


def test_echo_without_logprobs_returns_the_prompt_text():
    choice = post("/v1/completions", {**COMPLETION, "prompt": "abc", "echo": True}).json()["choices"][0]
    assert choice["text"] == "abchello world" and choice["logprobs"] is None


def test_max_tokens_zero_with_echo_scores_the_prompt_alone():
    engine = FakeEngine(script=lambda request: [outputs_for("x")[0].__class__(req_id="", token_ids=[], finished=True,
                                                                               finish_reason="length")])
    reply = post("/v1/completions", {**COMPLETION, "prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0},
                 engine)
    body = reply.json()
    assert body["choices"][0]["text"] == "abc" and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -ord("b") / 100, -ord("c") / 100]
    assert engine.requests[0].max_tokens == 0 and engine.requests[0].sampling.prompt_logprobs == 1


def test_impossible_tokens_are_reported_as_minus_9999():
    engine = FakeEngine(script=lambda request: outputs_for("\x00a", pieces=1))
    content = post("/v1/chat/completions", {**CHAT, "logprobs": True}, engine).json()["choices"][0]["logprobs"]
    assert content["content"][0]["logprob"] == IMPOSSIBLE == -9999.0


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),  # without echo
    ("/v1/completions", {**COMPLETION, "echo": 1}, "echo"),
])
def test_bad_logprob_fields_are_400_naming_them(path, body, param):
    engine = FakeEngine()
    reply = post(path, body, engine)
    assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body
    assert engine.requests == []


def byte_level_tokenizer():
    """A small byte-level BPE tokenizer (GPT-2's alphabet, as SmolLM2's), trained on text without emoji."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello wörld, hello world"] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|im_end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_texts_give_a_byte_level_tokens_real_bytes():
    texts = TokenTexts(byte_level_tokenizer())
    ids = texts.tokenizer.encode("wörld 😀<|im_end|>", add_special_tokens=False)
    got = [texts.of(t) for t in ids]
    assert b"".join(bytes(raw) for _, raw in got) == "wörld 😀<|im_end|>".encode()
    assert any(text == "\ufffd" for text, _ in got)  # the emoji is split into bytes, which decode to U+FFFD
    assert got[-1] == ("<|im_end|>", list(b"<|im_end|>"))  # special tokens as their text


def test_token_texts_of_a_tokenizer_that_is_not_byte_level_are_utf8_of_the_text():
    texts = TokenTexts(ByteTokenizer())
    assert texts.byte_map is None and texts.of(ord("a")) == ("a", [ord("a")])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_tokens_logprobs_and_usage_where_it_ends_the_text(stream):
    """One engine output of 11 tokens (a speculative round can commit several) with the stop string "lo" inside:
    the answer, its logprobs and its usage end with the token that completed "lo"."""
    engine = FakeEngine(script=lambda request: outputs_for("hello world", pieces=1))
    body = {**CHAT, "logprobs": True, "stop": ["lo"], "stream": stream, "stream_options": {"include_usage": True}} \
        if stream else {**CHAT, "logprobs": True, "stop": ["lo"]}
    reply = post("/v1/chat/completions", body, engine)
    if stream:
        events = [json.loads(e) for e in reply.events()[:-1]]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        entries = [x for e in events if e["choices"] and e["choices"][0]["logprobs"] for x in
                   e["choices"][0]["logprobs"]["content"]]
        usage = events[-1]["usage"]
    else:
        choice = reply.json()["choices"][0]
        content, entries, usage = choice["message"]["content"], choice["logprobs"]["content"], reply.json()["usage"]
    assert content == "hel"
    assert [e["token"] for e in entries] == list("hello") and usage["completion_tokens"] == 5
