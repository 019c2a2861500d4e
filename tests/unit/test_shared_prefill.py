"""One prefill for requests with the same prompt (target_worker/shared_prefill.py): each request that takes another's
prefill generates what it generates alone, token for token (seeded sampling and greedy, with drafts), and the
prefill is shared only where it may be."""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3] * 3  # 45 tokens: 6 chunks of 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", varied=True)


def engine_for(model) -> InProcessEngine:
    return InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4, max_num_batched_tokens=8),
                           proposer=OracleForesight(model, cuts=2))


def run_together(model, mode: str, requests: list[dict]) -> tuple[list[dict], int]:
    """`requests` (prompt, seed, ... each) submitted at once; their results and the prefills shared."""
    engine = engine_for(model)
    try:
        ids = [engine.submit(r.pop("prompt"), 24, mode, **r) for r in requests]
        results = engine.collect(ids)
        return [results[i] for i in ids], engine.target.prefills_shared
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_requests_with_one_prompt_share_its_prefill_and_generate_as_alone(model, mode):
    """Three seeded samples and a greedy request on one prompt: one prefill, four answers, each the one it gets
    served alone."""
    asks = [dict(temperature=1.0, seed=s) for s in (1, 2, 3)] + [dict(temperature=0.0)]
    together, shared = run_together(model, mode, [dict(prompt=PROMPT, **a) for a in asks])
    alone = [run_together(model, mode, [dict(prompt=PROMPT, **a)])[0][0] for a in asks]
    assert shared == 3
    assert all(t["error"] is None for t in together)
    assert [t["tokens"] for t in together] == [a["tokens"] for a in alone]
    assert len({tuple(t["tokens"]) for t in together[:3]}) > 1  # the seeds do differ


def test_other_prompts_and_prompt_logprobs_prefill_alone(model):
    _, shared = run_together(model, "ar", [dict(prompt=PROMPT, temperature=0.0),
                                          dict(prompt=PROMPT[1:], temperature=0.0),
                                          dict(prompt=PROMPT, temperature=0.0, prompt_logprobs=1)])
    assert shared == 0
