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


def scripted_drafter(target, sequences) -> ScriptedForesight:
    """On its own copy of the target, as the drafter process loads one: the target worker hooks the
    Gated DeltaNet mixers of its model during a verify (linear_rollback.py), which a second thread running
    the same modules would disturb."""
    target = tiny_model(target.config.model_type.removesuffix("_text"))
    decoder = ForesightDecoder(target, 2)  # layer 2 (Gated DeltaNet) + layer 3 (full attention): input index 2
    n = target.config.num_hidden_layers
    draft = DraftModel(DraftConfig.for_target(target.config, target_layers=[1, 2, n], num_layers=1),
                       SharedWeights.from_target(target)).eval()
    return ScriptedForesight(target, draft, OracleAdapter(target, [1, 2], sequences), decoder, cache_size=4,
                             temperature=0.0)


def test_pipelined_greedy_equals_plain_greedy_and_foresight_hits(target):
    want = plain_greedy(target, PROMPT, NEW, eos=target.config.eos_token_id)
    drafter = scripted_drafter(target, [PROMPT + want])
    assert drafter.state_layers == [2]
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
    (adopted, stale), = drafter.decoder_stats
    assert adopted >= drafter.foresee_calls and stale == 0  # each call took the snapshot of its context


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_the_real_adapter_and_draft_model_are_lossless(target, mode):
    """Nothing scripted: the adapter (initialised from the target's layers, Gated DeltaNet ones included),
    a random draft model and the decoder over the target's snapshots, through the round protocol."""
    from foresight.drafter_worker.foresight import ForesightDrafter
    from foresight.models.adapter import Adapter

    own = tiny_model(target.config.model_type.removesuffix("_text"))  # the drafter's copy (see scripted_drafter)
    n = own.config.num_hidden_layers
    torch.manual_seed(0)
    draft = DraftModel(DraftConfig.for_target(own.config, target_layers=[1, 2, n], num_layers=1),
                       SharedWeights.from_target(own)).eval()
    drafter = ForesightDrafter(draft, Adapter.from_target(own, [1, 2]).eval(), ForesightDecoder(own, 2),
                               passes=1, cache_size=4, use_budget=False)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, NEW, mode=mode, temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == plain_greedy(target, PROMPT, NEW, eos=target.config.eos_token_id)
    assert sum(r.drafted for r in got["rounds"]) > 0
    if mode == "pipelined":  # foresight ran through (a failing job would only log and miss) and hit
        assert all(r.cache_hit is not None for r in got["rounds"])
        assert drafter.stats.outcomes > 0 and sum(bool(r.cache_hit) for r in got["rounds"]) > 0
