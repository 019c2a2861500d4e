"""`foresight bench --peers`: which peers run, and transformers' generate as a peer on a tiny model."""
import pytest
from foresight.bench.peers import PROMPT_LOOKUP_TOKENS, HfPeers, Peer, plan_peers
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
