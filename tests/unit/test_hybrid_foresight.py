"""Pipelined foresight on Gated DeltaNet hybrids (tiny random Qwen3.5 and Qwen3-Next), end to end.

The target sends its committed linear-attention state with each outcome and the decoder continues from
it. With a perfect (oracle) adapter the decoder is then exact, so at temperature 0 foresight names the
realised outcome of every round it ran for: the cache hit rate shows the snapshots are right and used.
Drafts are scripted (support/scripted_foresight.py) so that rounds end at every accept length.
"""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.models.adapter import Adapter
from foresight.models.decoder import ForesightDecoder
from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights
from support.inprocess import InProcessEngine
from support.oracle_adapter import OracleAdapter
from support.scripted_foresight import ScriptedForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)
GAMMA = 5
PROMPT = [3, 17, 60, 61, 62, 11, 12, 13, 40, 41]
NEW = 200


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def target(request):
    return tiny_model(request.param)


def scripted_drafter(target, sequences: list[list[int]] | None) -> ScriptedForesight:
    """On its own copy of the target, as the drafter process loads one: the target worker hooks the
    Gated DeltaNet mixers of its model during a verify (linear_rollback.py), which a second thread running
    the same modules would disturb. With the oracle adapter for `sequences`, else the real adapter
    initialised from the target's layers."""
    target = tiny_model(target.config.model_type.removesuffix("_text"))
    decoder = ForesightDecoder(target, 2)  # layer 2 (Gated DeltaNet) + layer 3 (full attention): input index 2
    n = target.config.num_hidden_layers
    draft = DraftModel(DraftConfig.for_target(target.config, target_layers=[1, 2, n], num_layers=1),
                       SharedWeights.from_target(target)).eval()
    adapter = Adapter.from_target(target, [1, 2]).eval() if sequences is None else OracleAdapter(target, [1, 2],
                                                                                                   sequences)
    return ScriptedForesight(target, draft, adapter, decoder, cache_size=4, temperature=0.0)


def test_pipelined_greedy_equals_plain_greedy_and_foresight_hits(target):
    want = plain_greedy(target, PROMPT, NEW, eos=target.config.eos_token_id)
    drafter = scripted_drafter(target, [PROMPT + want])
    assert drafter.layout.state_layers == (2,)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, NEW, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == want
    rounds = got["rounds"]
    accepted = [r.accepted for r in rounds if r.drafted]
    assert len(set(accepted)) >= 4 and sum(0 < a < GAMMA for a in accepted) >= len(accepted) // 2
    # The decoder named the realised outcome every time it ran, but possibly the last (its outcome may come
    # after the request ended). A job whose outcome came first is skipped as stale: no call, a miss.
    hits = sum(bool(r.cache_hit) for r in rounds)
    assert drafter.foresee_calls > len(rounds) // 2 and hits >= drafter.foresee_calls - 1
    assert max(drafter.decoder_errors) < 1e-4  # with the oracle adapter the decoder is the target's own top
    (adopted, stale), = drafter.decoder_stats.values()
    assert adopted >= drafter.foresee_calls and stale == 0  # each call took the snapshot of its context


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_the_real_adapter_and_draft_model_are_lossless(target, mode):
    """Nothing scripted: the adapter (initialised from the target's layers, Gated DeltaNet ones included),
    a random draft model and the decoder over the target's snapshots, through the round protocol."""
    from foresight.drafter_worker.decoder_scorer import AdapterDecoderScorer
    from foresight.drafter_worker.foresight import ForesightDrafter

    own = tiny_model(target.config.model_type.removesuffix("_text"))  # the drafter's copy (see scripted_drafter)
    n = own.config.num_hidden_layers
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.for_target(own.config, target_layers=[1, 2, n], num_layers=1),
                       SharedWeights.from_target(own)).eval()
    scorer = AdapterDecoderScorer(draft, Adapter.from_target(own, [1, 2]).eval(), ForesightDecoder(own, 2))
    drafter = ForesightDrafter(draft, scorer, passes=1, cache_size=4, use_budget=False)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, NEW, mode=mode, temperature=0.0)
        # Sampled: draws keyed by position make a seeded request's text the same in every mode
        sampled = engine.generate(PROMPT, 60, mode=mode, temperature=0.8, seed=7)
        plain = engine.generate(PROMPT, 60, mode="ar", temperature=0.8, seed=7)
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == plain_greedy(target, PROMPT, NEW, eos=target.config.eos_token_id)
    assert sum(r.drafted for r in got["rounds"]) > 0
    assert sampled["tokens"] == plain["tokens"] and sum(r.accepted for r in sampled["rounds"]) > 0
    if mode == "pipelined":  # foresight ran through (a failing job would only log and miss) and hit
        assert all(r.cache_hit is not None for r in got["rounds"])
        assert drafter.stats.outcomes > 0 and sum(bool(r.cache_hit) for r in got["rounds"]) > 0


@torch.inference_mode()
def draft_tests(drafter: ScriptedForesight, target, prompt: list[int], got: dict) -> tuple[list[float], list[int]]:
    """Every draft token verification tested in `got`'s rounds: the target's probability of the draft token
    given the committed prefix, and whether the committed token is that draft. The scripted drafts are a
    function of the committed tokens, so each round's block is drafted again here."""
    out, probs_at, hit_at = got["tokens"], [], []
    logits = target(torch.tensor([prompt + out])).logits[0].float()  # [T, vocab]
    c = 1  # output tokens committed before the round (the first came from the prefill)
    for r in got["rounds"]:
        block = drafter.scripted(prompt + out[:c], r.drafted) if r.drafted else []
        for j, d in enumerate(block[:r.accepted + 1]):
            if c + j >= len(out):
                break  # cut by max_tokens
            probs_at.append(float(torch.softmax(logits[len(prompt) + c + j - 1], -1)[d]))
            hit_at.append(int(out[c + j] == d))
        c += r.accepted + 1
    return probs_at, hit_at


@pytest.mark.parametrize("arch", ["qwen3_5"])  # Qwen3-Next takes the same path, at twice the time
def test_sampled_pipelined_output_follows_the_target_distribution(arch):
    """T=1, pipelined, foresight ranking outcomes at the request's temperature. Lossless verification
    commits a draft token d with exactly the target's probability p(d | prefix), whatever proposed it:
    over many seeds, the number of draft tokens committed must match the sum of those probabilities
    within 5 standard errors (the draws are martingale differences). Its power is for gross errors: a
    verifier that also accepted 10 % of the drafts it should reject moved the count by 1.9 standard errors
    and passed; the exactness of the hybrid state is tested by the logits above and in test_training.py."""
    prompt, new, requests = PROMPT[:6], 16, 32
    target = tiny_model(arch)
    drafter = scripted_drafter(target, None)  # sampled sequences: the real adapter (the oracle knows greedy ones)
    drafter.temperature, drafter.check_decoder = None, False  # rank outcomes at the request's temperature
    drafter.cache_size = 2  # two outcomes pre-drafted per round: scripted drafts cost target forwards
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:  # one at a time: with many in flight most foresight jobs find their outcome already in (stale)
        results = [engine.generate(prompt, new, mode="pipelined", temperature=1.0, seed=s) for s in range(requests)]
    finally:
        engine.close()
    probs, hits, cache_hits = [], [], 0
    for got in results:
        assert got["error"] is None
        p, h = draft_tests(drafter, target, prompt, got)
        probs += p
        hits += h
        cache_hits += sum(bool(r.cache_hit) for r in got["rounds"])
    p = torch.tensor(probs, dtype=torch.float64)
    expected, sd = p.sum().item(), (p * (1 - p)).sum().sqrt().item()
    print(f"\n{len(hits)} draft tests: {sum(hits)} committed, expected {expected:.1f} (sd {sd:.1f}); "
          f"{cache_hits} cache hits")
    assert cache_hits > 0 and len(hits) > 200
    assert abs(sum(hits) - expected) <= 5 * sd


def test_worker_processes_serve_a_hybrid_target_in_every_mode(tmp_path):
    """Through spawned target and drafter processes, as `foresight serve` runs them: the drafter asks for
    the decoder's linear layers, the target is started with them, and greedy output in ar, sync and
    pipelined equals plain greedy decoding."""
    import asyncio

    from foresight.protocol.messages import GenerateRequest, SamplingParams
    from foresight.server.engine_client import EngineClient
    from support.tiny_models import save_tiny_model

    target = tiny_model("qwen3_5")
    n = target.config.num_hidden_layers
    DraftModel(DraftConfig.for_target(target.config, target_layers=[1, 2, n], num_layers=1),
               SharedWeights.from_target(target)).save(tmp_path / "drafter")
    Adapter.from_target(target, [1, 2]).save(tmp_path / "drafter" / "adapter")
    cfg = EngineConfig(target=str(save_tiny_model("qwen3_5", tmp_path)), drafter=str(tmp_path / "drafter"),
                       dtype="float32", mode="pipelined", decoder_layers=2,
                       drafter_compile="off")  # a fresh random draft model: its pass would compile at every run
    want = plain_greedy(target, PROMPT, NEW, eos=target.config.eos_token_id)

    async def serve() -> tuple[dict, dict]:
        engine = EngineClient(cfg)
        await engine.start()
        try:
            got = {}
            for mode in ("ar", "sync", "pipelined"):
                req = GenerateRequest(req_id=mode, prompt_ids=PROMPT, max_tokens=NEW, mode=mode,
                                      sampling=SamplingParams(temperature=0.0))
                got[mode] = [t async for out in engine.generate(req) for t in out.token_ids]
            return got, engine.supervisor._pair_drafter
        finally:
            await engine.stop()

    got, drafter = asyncio.run(serve())
    assert drafter.layout.state_layers == (2,) and drafter.info["supports_foresight"]
    assert got == {"ar": want, "sync": want, "pipelined": want}
