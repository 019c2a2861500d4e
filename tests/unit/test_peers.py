"""`foresight bench --peers`: which peers run, transformers' generate as a peer on a tiny model, and
llama.cpp as a peer on the embedded default."""
import sys
from pathlib import Path

import pytest
from foresight.bench.llamacpp_peer import LlamaCppPeers, bf16_path, open_server, source_gguf
from foresight.bench.peers import PROMPT_LOOKUP_TOKENS, HfPeers, Peer, open_peers, plan_peers
from foresight.config import ConfigError, EngineConfig
from foresight.protocol.messages import GenerateRequest, SamplingParams
from support.tiny_models import plain_greedy, save_tiny_model


def test_plan_hf_peers_with_the_workers_threads_and_one():
    names = [p.name for p in plan_peers("hf", EngineConfig(target_threads=1, drafter_threads=1))]
    assert names == ["hf@2t", "hf@1t", "hf-pld@2t", "hf-pld@1t"]
    peers = plan_peers("hf", EngineConfig())
    assert {p.prompt_lookup for p in peers} == {None, PROMPT_LOOKUP_TOKENS}
    assert plan_peers("", EngineConfig()) == []
    with pytest.raises(ConfigError, match="peers"):
        plan_peers("vllm", EngineConfig())
    with pytest.raises(ConfigError, match="peers.*'vllm'"):
        plan_peers("llamacpp,vllm", EngineConfig())


def test_plan_hf_and_llamacpp_peers():
    peers = plan_peers("hf,llamacpp", EngineConfig(target_threads=1, drafter_threads=1))
    assert [p.name for p in peers] == ["hf@2t", "hf@1t", "hf-pld@2t", "hf-pld@1t", "llamacpp@2t", "llamacpp@1t",
                                       "llamacpp-bf16@2t", "llamacpp-bf16@1t"]
    assert [(p.kind, p.bf16, p.threads) for p in peers[4:]] == [("llamacpp", False, 2), ("llamacpp", False, 1),
                                                                ("llamacpp", True, 2), ("llamacpp", True, 1)]
    assert plan_peers("llamacpp,llamacpp", EngineConfig()) == plan_peers("llamacpp", EngineConfig())


def test_llamacpp_peer_refuses_a_target_without_gguf(tmp_path):
    path = save_tiny_model("llama", tmp_path)
    cfg = EngineConfig(target=str(path), dtype="float32", drafter="ngram")
    with pytest.raises(ConfigError, match="peers.*GGUF"):
        open_peers(cfg, plan_peers("llamacpp", cfg))


def test_llamacpp_peer_without_xllamacpp_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # `import xllamacpp` raises ImportError
    with pytest.raises(ConfigError, match="peers.*pip install xllamacpp"):
        open_server(Path("unused.gguf"), 1)


def test_hf_peer_greedy_equals_plain_greedy(tmp_path):
    path = save_tiny_model("llama", tmp_path)
    cfg = EngineConfig(target=str(path), dtype="float32", drafter="ngram")
    peers = [Peer("hf@1t", 1), Peer("hf-pld@1t", 1, PROMPT_LOOKUP_TOKENS)]
    hf = HfPeers(cfg, peers)
    prompt = [5, 17, 33, 2, 60, 5, 17]
    request = GenerateRequest(req_id="p", prompt_ids=prompt, max_tokens=12, sampling=SamplingParams(temperature=0.0))
    hf.warm_up(request)
    assert all(t.outputs == [] and t.wall_s == 0.0 for t in hf.tallies.values())  # not counted
    hf.run_all(request)
    want = plain_greedy(hf.model, prompt, 12, eos=hf.eos[0])
    section = hf.section([want], {"ar": {"tokens_per_s": 10.0}})
    for name in ("hf@1t", "hf-pld@1t"):
        assert hf.tallies[name].outputs == [want]
        assert section[name]["outputs_match_ar"] == 1.0 and section[name]["threads"] == 1
        assert section[name]["tokens_per_s"] > 0 and section[name]["modes_vs_peer"]["ar"] > 0


@pytest.mark.integration
def test_llamacpp_peers_generate_on_the_default_gguf_and_its_bf16_rewrite():
    cfg = EngineConfig()  # the embedded default: SmolLM2-135M-Instruct, Q4_1 GGUF
    peers = [Peer("llamacpp@1t", 1, kind="llamacpp"), Peer("llamacpp-bf16@1t", 1, kind="llamacpp", bf16=True)]
    llama = LlamaCppPeers(cfg, peers)  # writes the BF16 rewrite on first use (~5 s), then reuses it
    assert bf16_path(source_gguf(cfg)).is_file()
    # "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n" in the target's tokens
    prompt = [1, 4093, 198, 36218, 15876, 30, 2, 198, 1, 520, 9531, 198]
    request = GenerateRequest(req_id="p", prompt_ids=prompt, max_tokens=8, sampling=SamplingParams(temperature=0.0))
    llama.warm_up(request)
    assert all(t.outputs == [] and t.wall_s == 0.0 for t in llama.tallies.values())  # not counted
    llama.run_all(request)
    llama.run_all(request)
    section = llama.section(None, {"ar": {"tokens_per_s": 10.0}})
    for peer in peers:
        first, again = llama.tallies[peer.name].outputs
        assert 0 < len(first) <= 8 and all(isinstance(t, int) for t in first)
        assert again == first  # greedy, no prompt cache: the same tokens again
        assert section[peer.name]["tokens_per_s"] > 0 and section[peer.name]["threads"] == 1
    assert section["llamacpp-bf16@1t"]["gguf"].endswith(".bf16.gguf")
