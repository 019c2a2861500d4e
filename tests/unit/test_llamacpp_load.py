"""llama.cpp's server as a peer under load (bench/llamacpp_load.py): planning, prompt ids, bodies, server
settings, ratios against `ar`; and one real 2-slot server on the embedded default driven by the load
bench's own client."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from foresight.bench import load
from foresight.bench.llamacpp_load import (CTX_ROUND, LoadPeers, item_prompt_ids, load_params, peer_body,
                                           plan_load_peers, slot_context)
from foresight.bench.llamacpp_peer import SAMPLERS
from foresight.bench.peers import Peer
from foresight.config import ConfigError, EngineConfig

ARGS = argparse.Namespace(max_tokens=8, temperature=0.0, seed=3, peers="llamacpp")


def test_plan_load_peers_at_the_workers_total_threads_only():
    assert [p.name for p in plan_load_peers("llamacpp", EngineConfig())] == ["llamacpp@2t", "llamacpp-bf16@2t"]
    peers = plan_load_peers("llamacpp", EngineConfig(target_threads=3, drafter_threads=1))
    assert [(p.name, p.threads, p.bf16) for p in peers] == [("llamacpp@4t", 4, False), ("llamacpp-bf16@4t", 4, True)]
    assert plan_load_peers("", EngineConfig()) == []
    for spec in ("hf", "llamacpp,hf"):
        with pytest.raises(ConfigError, match="only llamacpp"):
            plan_load_peers(spec, EngineConfig())


class FakeTokenizer:
    eos_token_id = 2

    def __len__(self):
        return 200  # the vocabulary a token-id prompt is checked against

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return {"input_ids": [1] + [len(m["content"]) for m in messages], "attention_mask": [1] * 3}

    def encode(self, text, add_special_tokens):
        assert not add_special_tokens  # as Foresight's server encodes a text prompt
        return [ord(c) for c in text]


def test_item_prompt_ids_as_foresights_server_makes_them():
    tok = FakeTokenizer()
    messages = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}]
    assert item_prompt_ids(tok, {"messages": messages}) == [1, 3, 2]
    assert item_prompt_ids(tok, {"prompt": "hi"}) == [104, 105]
    assert item_prompt_ids(tok, {"prompt": ["hi"]}) == [104, 105]
    assert item_prompt_ids(tok, {"prompt": ""}) == [2]  # nothing to encode: the eos, as the server sends
    assert item_prompt_ids(tok, {"prompt": [5, 6]}) == [5, 6]


def test_slot_context_holds_the_longest_prompt_and_its_output():
    assert slot_context([[1] * 10, [1] * 98], 32) == CTX_ROUND
    assert slot_context([[1] * 200], 56) == 2 * CTX_ROUND  # 257 cells needed
    assert slot_context([[1] * 199], 56) == CTX_ROUND


def test_peer_body_is_the_modes_body_with_token_ids():
    path, body = peer_body([1, 2, 3], 4, ARGS)
    mode_path, mode_body = load.request_body({"prompt": "x"}, 4, ARGS)
    assert path == mode_path == "/v1/completions"
    assert body["prompt"] == [1, 2, 3]
    for key in ("max_tokens", "temperature", "seed", "stream", "stream_options"):
        assert body[key] == mode_body[key], key
    assert body["seed"] == 7 and body["stream_options"] == {"include_usage": True}
    assert body["samplers"] == SAMPLERS and body["top_k"] == 0 and body["top_p"] == 1.0  # Foresight's defaults


def test_load_params_give_every_level_a_slot_on_loopback(tmp_path):
    pytest.importorskip("xllamacpp")
    p = load_params(tmp_path / "m.gguf", 2, 16, 512)
    assert p.n_parallel == 16 and p.n_ctx == 16 * 512 and p.cont_batching and not p.kv_unified
    assert p.cpuparams.n_threads == 2 and p.cpuparams_batch.n_threads == 2
    assert p.n_threads_http >= 16 and list(p.hostnames) == ["127.0.0.1"] and p.port == 0
    assert not p.cache_prompt  # llamacpp_peer's settings kept


def test_ratios_vs_ar_cover_the_peers():
    section = {"1": {"ar": {"tokens_per_s_runs": [10.0, 20.0]}, "llamacpp@2t": {"tokens_per_s_runs": [15.0, 20.0]}},
               "8": {"ar": {"tokens_per_s_runs": [40.0]}, "llamacpp-bf16@2t": {"tokens_per_s_runs": [20.0]}}}
    ratios = load.ratios_vs_ar(section)
    assert ratios["1"]["llamacpp@2t"] == {"median": 1.25, "runs": [1.5, 1.0]}
    assert ratios["8"]["llamacpp-bf16@2t"] == {"median": 0.5, "runs": [0.5]}


def test_no_peers_without_the_flag():
    peers = load.load_peers(argparse.Namespace(peers="", max_tokens=8), EngineConfig(), [{"prompt": "x"}], [1, 4])
    assert peers.names == [] and peers.info() == {}

    async def go():
        async with peers.serving(None, 0, ARGS, {}) as bases:
            return bases

    assert asyncio.run(go()) == {}
    with pytest.raises(ConfigError, match="only llamacpp"):
        load.load_peers(argparse.Namespace(peers="hf", max_tokens=8), EngineConfig(), [{"prompt": "x"}], [1])


def test_run_level_sends_a_peers_bodies():
    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content)["prompt"]))
        events = [{"choices": [{"text": "t"}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    peers = LoadPeers(EngineConfig(), [], [], 2, ARGS)
    peers.ids = [[1, 2], [3]]  # as __init__ tokenizes the items when peers are planned

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await load.run_level(client, "http://test", [{"prompt": "a"}, {"prompt": "b"}], 2, 3, ARGS, {},
                                        peers.body)

    results, _ = asyncio.run(go())
    assert all(r.status == "ok" for r in results)
    assert sorted(seen) == [("/v1/completions", [1, 2]), ("/v1/completions", [1, 2]), ("/v1/completions", [3])]


@pytest.mark.integration
def test_a_two_slot_llamacpp_server_streams_two_requests_at_once():
    pytest.importorskip("xllamacpp")
    cfg = EngineConfig()  # the embedded default: SmolLM2-135M-Instruct, Q4_1 GGUF
    items = [{"messages": [{"role": "user", "content": "Say hi."}]},
             {"messages": [{"role": "user", "content": "Name a colour."}]}]
    peers = LoadPeers(cfg, [Peer("llamacpp@1t", 1, kind="llamacpp")], items, 2, ARGS)
    # "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    assert peers.ids[0][:2] == [1, 9690] and peers.ids[0][-3:] == [520, 9531, 198]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            async with peers.serving(client, 0, ARGS, {}) as bases:
                base = bases["llamacpp@1t"]
                results, wall_s = await load.run_level(client, base, items, 2, 2, ARGS, {}, peers.body)
            with pytest.raises(httpx.ConnectError):  # stopped on leaving
                await client.get(base + "/health")
        return results, wall_s

    results, wall_s = asyncio.run(go())
    assert len(results) == 2 and wall_s > 0
    for r in results:
        assert r.status == "ok", r.error
        assert 0 < r.output_tokens <= 8 and r.chunk_times and r.ttft > 0
    first, second = sorted(results, key=lambda r: r.start)
    assert second.start < first.end  # both in flight at once
    info = peers.info()["llamacpp@1t"]
    assert info["n_parallel"] == 2 and info["gguf"].endswith(".gguf") and len(info["load_s"]) == 1
