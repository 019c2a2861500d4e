"""Rollback after rejections of every length, on tiny models whose greedy text follows the context
(`tiny_model(..., varied=True)`): a cache that keeps a rejected draft, or loses a kept token, changes the next
logits and the output. Every cache kind is covered: full attention (Llama, Qwen3), sliding windows (Gemma3) and
Gated DeltaNet state (Qwen3.5, Qwen3-Next)."""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.target_worker.runner import TargetRunner
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

ARCHS = ["llama", "qwen3", "gemma3", "qwen3_5", "qwen3_next"]
DRAFTS = 5  # block_size 6
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]  # longer than gemma3's window of 8


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, varied=True)


@torch.inference_mode()
def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32: one forward over the whole sequence, no cache."""
    return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("rejected", range(DRAFTS + 1))
def test_a_rollback_leaves_exactly_the_kept_tokens(model, rejected):
    """Verify [anchor, d_1..d_5], reject the last `rejected`: the cache then holds the prompt, the anchor and the
    kept drafts -- its length, and the logits of the next block, equal a full forward over those tokens."""
    runner = TargetRunner(model)
    cache = runner.new_cache()
    runner.prefill(cache, PROMPT)
    anchor, draft = 17, [23, 29, 31, 37, 43]
    result = runner.verify(cache, anchor, draft)
    torch.testing.assert_close(result.logits, full_logits(model, PROMPT + [anchor] + draft)[-(DRAFTS + 1):],
                               atol=1e-4, rtol=1e-4)
    runner.rollback(cache, rejected, result)
    kept = PROMPT + [anchor] + draft[:DRAFTS - rejected]
    assert cache.get_seq_length() == len(kept)
    block = [47, 53, 59]
    got = runner.verify(cache, block[0], block[1:]).logits
    torch.testing.assert_close(got, full_logits(model, kept + block)[-len(block):], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_greedy_rounds_rejecting_every_number_of_drafts_equal_plain_greedy(model, mode):
    """Drafts are the target's own greedy text, cut at a random position (or not at all): rounds accept none,
    some and all of their drafts, and the output is still plain greedy decoding's."""
    proposer = OracleForesight(model, cuts=1)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=DRAFTS + 1), proposer=proposer,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 60, mode=mode, temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    want = plain_greedy(model, PROMPT, 60, eos=model.config.eos_token_id)
    assert got["tokens"] == want
    assert len(set(want)) >= 6, want  # the text is not one token repeated: the cache decides it
    drafted = [r for r in got["rounds"] if r.drafted]
    rejected = {r.drafted - r.accepted for r in drafted}
    assert 0 in rejected and any(0 < r.accepted < r.drafted for r in drafted), rejected
    assert any(r.accepted == 0 for r in drafted) and len(rejected) >= 4, rejected
