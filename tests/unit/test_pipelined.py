"""The pipelined round protocol: speculation cache hits and misses, stale entries, losslessness."""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.drafter_worker.speculation_cache import CacheEntry, ForeseenBlocks
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("wrong", [False, True], ids=["forced-hit", "forced-miss"])
def test_pipelined_greedy_equals_plain_greedy(model, wrong):
    proposer = OracleForesight(model, wrong=wrong)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 40, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == plain_greedy(model, PROMPT, 40, eos=model.config.eos_token_id)
    lookups = [r.cache_hit for r in got["rounds"]]
    assert None not in lookups  # every pipelined round consults the cache
    assert not lookups[0]  # round 1 follows the prefill: nothing was foreseen for it
    hits = sum(lookups)
    if wrong:
        assert hits == 0 and proposer.foresee_calls > 0
    else:
        # Every foresight whose outcome came back was a hit (the last one may have outlived the request;
        # one that started after its outcome arrived is stale and skipped, not counted).
        assert hits >= proposer.foresee_calls - 1 and hits > 0
    assert {r.accepted for r in got["rounds"]} != {5}  # outcomes vary: the cache had real choices to get right


def test_sync_requests_never_consult_the_cache(model):
    proposer = OracleForesight(model)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 20, mode="sync", temperature=0.0)
    finally:
        engine.close()
    assert all(r.cache_hit is None for r in got["rounds"]) and proposer.foresee_calls == 0


def test_cache_answers_only_its_own_round_and_is_spent_by_a_lookup():
    cache = ForeseenBlocks()
    entry = CacheEntry(accepted=2, bonus=7, tokens=(1, 2, 3))
    cache.fill(5, [entry])
    assert cache.take(4, 2, 7) is None  # stale: made for round 5
    cache.fill(5, [entry])
    assert cache.take(5, 2, 8) is None  # another outcome
    assert cache.take(5, 2, 7) is None  # spent by the previous lookup
    cache.fill(5, [entry])
    assert len(cache) == 1 and cache.take(5, 2, 7) == entry and len(cache) == 0


def test_pipelined_is_refused_without_a_foresight_drafter(model):
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6))
    try:
        got = engine.generate(PROMPT, 5, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] and "foresight" in got["error"]


class UnendingForesight(OracleForesight):
    """Foresight that would never finish on its own: it works until a message waits (at most WAIT_CAP_S,
    then it gives up and counts an overrun), then returns the oracle's entries, computed by then."""

    WAIT_CAP_S = 20.0

    def __init__(self, model):
        super().__init__(model)
        self.interrupted = self.overran = 0

    def foresee(self, ctx, block, max_drafts, budget_s, stop=None, confidence=()):
        import time

        entries = super().foresee(ctx, block, max_drafts, budget_s)
        deadline = time.perf_counter() + self.WAIT_CAP_S
        while not (stop is not None and stop()):
            if time.perf_counter() > deadline:
                self.overran += 1
                return entries
            time.sleep(0.001)
        self.interrupted += 1
        return entries


def test_an_outcome_that_arrives_during_foresight_ends_the_job(model):
    """The drafter checks its socket between stages: the next outcome ends a foresight job that would run
    on, and the partial result (here: all of it) answers that outcome from the cache."""
    proposer = UnendingForesight(model)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer)
    try:
        got = engine.generate(PROMPT, 30, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    assert got["tokens"] == plain_greedy(model, PROMPT, 30, eos=model.config.eos_token_id)
    # Every job that started ended on a message, never on its own cap. (Under load a job may also be skipped
    # as stale: its outcome came before it started. How many run is timing; that none overruns is not.)
    assert proposer.overran == 0 and proposer.interrupted >= 1
    # Each interrupted job cached its (oracle, always right) entries before its outcome was handled, so
    # every one of them but the last (ended by the request's release) answered a round from the cache.
    assert sum(bool(r.cache_hit) for r in got["rounds"]) >= proposer.interrupted - 1
