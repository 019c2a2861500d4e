"""Under load the worker measures whether rounds that draft pay for everyone, and holds them to the target
alone when they do not; a lone request always decides alone."""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.control.load_policy import (EXPLORE_WINDOWS, POLICIES, WINDOW_STEPS, LoadPolicy, load_bucket,
                                                 winner)
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model
from test_foresight import make_draft_model

torch.set_num_threads(1)


def run(policy: LoadPolicy, windows: int, tokens_per_s: dict[str, float], running: int = 8) -> dict[str, int]:
    """Feed `windows` windows of steps at the scripted throughput of each policy; count windows per policy."""
    counts = dict.fromkeys(POLICIES, 0)
    for _ in range(windows * WINDOW_STEPS):
        counts[policy.current] += 1
        policy.observe(running, True, round(tokens_per_s[policy.current] * 0.1), 0.1)
    return {p: n // WINDOW_STEPS for p, n in counts.items()}


def test_the_fastest_policy_runs_and_the_others_are_still_tried():
    policy = LoadPolicy()
    counts = run(policy, 100, {"draft": 50.0, "lookup": 100.0, "plain": 80.0})
    assert counts["lookup"] > 0.8 * 100
    assert counts["draft"] >= 1 and counts["plain"] >= 2  # tried now and then: the workload may change
    counts = run(policy, 100, {"draft": 50.0, "lookup": 80.0, "plain": 100.0})  # lookup stops paying
    assert counts["plain"] > 0.7 * 100
    rates = {"draft": 150.0, "lookup": 80.0, "plain": 100.0}  # drafting pays again: noticed at its next trial
    run(policy, 100, rates)
    assert run(policy, 100, rates)["draft"] > 0.8 * 100


def test_exploring_costs_little_in_a_steady_load():
    """Trials of the worse policies (drafting at half the best, lookup at 0.9) cost about 1 % of throughput:
    a trial settles for SETTLE_STEPS, not a whole window, and rivals wait EXPLORE_WINDOWS / r**2 windows."""
    policy = LoadPolicy()
    rates = {"draft": 50.0, "lookup": 90.0, "plain": 100.0}
    tokens = seconds = 0.0
    for _ in range(400 * WINDOW_STEPS):
        step_tokens = round(rates[policy.current] * 0.1)
        tokens, seconds = tokens + step_tokens, seconds + 0.1
        policy.observe(8, True, step_tokens, 0.1)
    assert tokens / seconds > 0.985 * rates["plain"]


def test_drafting_must_beat_the_target_alone_by_a_margin():
    assert winner({"draft": 105.0, "lookup": 100.0, "plain": 90.0}) == "lookup"
    assert winner({"draft": 115.0, "lookup": 100.0, "plain": 90.0}) == "draft"
    assert winner({"draft": 50.0, "lookup": 90.0, "plain": 100.0}) == "plain"
    assert winner({"draft": 50.0}) == "draft"


def test_prompt_lookup_must_beat_plain_steps_by_a_margin():
    assert winner({"draft": 50.0, "lookup": 103.0, "plain": 100.0}) == "plain"  # a near tie: the safe choice
    assert winner({"draft": 50.0, "lookup": 106.0, "plain": 100.0}) == "lookup"
    assert winner({"draft": 50.0, "lookup": 90.0}) == "lookup"  # plain not measured yet
    assert winner({"draft": 113.0, "lookup": 103.0, "plain": 100.0}) == "draft"  # against the one that would run


def test_held_rounds_take_lookup_only_where_the_request_allows_it():
    policy = LoadPolicy()
    policy.current = "lookup"
    assert [policy.held_strategy(m) for m in ("auto", "ngram", "sync", "pipelined", "ar")] == \
        ["ngram", "ngram", "ar", "ar", "ar"]
    policy.current = "plain"
    assert {policy.held_strategy(m) for m in ("auto", "ngram", "sync", "pipelined", "ar")} == {"ar"}


def test_a_lone_request_or_an_uncontested_batch_always_drafts():
    policy = LoadPolicy()
    run(policy, 20, {"draft": 10.0, "lookup": 100.0, "plain": 100.0})
    assert policy.local
    policy.observe(1, True, 1, 0.1)
    assert not policy.local
    run(policy, 20, {"draft": 10.0, "lookup": 100.0, "plain": 100.0})
    policy.observe(8, False, 1, 0.1)
    assert not policy.local
    assert [load_bucket(n) for n in (1, 2, 2.9, 3.8, 5.9, 7.5, 11.9, 12, 30)] == [0, 2, 2, 4, 4, 8, 8, 16, 16]


def test_a_request_that_ends_and_the_next_that_arrives_do_not_restart_the_window():
    """Closed-loop clients: the running count dips for a step when a request ends; the policy must still
    measure its windows and settle on the faster policy."""
    policy = LoadPolicy()
    rates = {"draft": 50.0, "lookup": 100.0, "plain": 100.0}
    local_steps = 0
    for step in range(60 * WINDOW_STEPS):
        running = 3 if step % 15 == 0 else 4  # a request ends every 15 steps, its successor arrives next step
        local_steps += policy.local
        policy.observe(running, True, round(rates[policy.current] * 0.1), 0.1)
    assert local_steps > 0.8 * 60 * WINDOW_STEPS


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_rounds_held_local_stay_exact_and_drafting_resumes(mode):
    """The policy holds drafting requests to the target alone for a while, then lets them draft again: every
    switch keeps greedy output equal to plain greedy decoding."""
    model = tiny_model("llama")
    proposer = JetSpecProposer(make_draft_model(model), passes=1)  # auto may choose hybrid with it
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer)
    try:
        policy = engine.target.planner.policy
        steps = [0]

        def alternate(running, contested, tokens, seconds):  # 3 steps of each policy in turn
            steps[0] += 1
            policy.current = ("draft", "plain", "lookup")[(steps[0] // 3) % 3]

        policy.observe = alternate
        prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 13, 40]]
        ids = [engine.submit(p, 40, mode=mode, temperature=0.0) for p in prompts]
        results = engine.collect(ids)
    finally:
        engine.close()
    held = {"ngram", "ar"} if mode == "auto" else {"ar"}  # "lookup" and "plain" windows
    for rid, prompt in zip(ids, prompts):
        assert results[rid]["tokens"] == plain_greedy(model, prompt, 40, eos=model.config.eos_token_id)
        strategies = {r.strategy for r in results[rid]["rounds"]}
        assert held <= strategies and strategies - held, strategies


def test_a_new_load_level_starts_from_what_the_nearest_one_learnt():
    policy = LoadPolicy()
    rates = {"draft": 50.0, "lookup": 70.0, "plain": 100.0}
    assert run(policy, 30, rates, running=4)["plain"] > 0.6 * 30
    counts = run(policy, 10, rates, running=8)
    assert counts["draft"] == 0  # drafting is not tried at the new level before the usual wait
    assert counts["lookup"] <= 2 and counts["plain"] >= 7  # the other way of running alone: one early trial


def test_a_higher_load_level_notices_soon_that_lookup_stopped_paying():
    policy = LoadPolicy()
    assert run(policy, 30, {"draft": 50.0, "lookup": 120.0, "plain": 100.0}, running=4)["lookup"] > 0.6 * 30
    counts = run(policy, 12, {"draft": 50.0, "lookup": 90.0, "plain": 100.0}, running=8)
    assert counts["plain"] >= 7 and counts["draft"] == 0  # lookup from below starts as plain; its early trial lost


def test_lookup_learnt_at_a_lower_load_is_tried_soon_and_kept_where_it_pays():
    rates = {"draft": 50.0, "lookup": 120.0, "plain": 100.0}
    policy = LoadPolicy()
    assert run(policy, 30, rates, running=4)["lookup"] > 0.6 * 30
    while policy._bucket != 8:
        policy.observe(8, True, 12, 0.1)
    assert policy.current == "plain"  # up to a higher load: plain steps until lookup's trial
    counts = run(policy, 20, rates, running=8)
    assert counts["lookup"] >= 14 and counts["draft"] == 0


def test_sixteen_requests_learn_apart_from_eight():
    """Prompt lookup pays at 8 requests and not at 16 (its extra positions cost more in a larger step): 16
    is measured apart from 8 and settles on plain steps, and 8 keeps lookup."""
    at_8 = {"draft": 50.0, "lookup": 120.0, "plain": 100.0}
    policy = LoadPolicy()
    assert run(policy, 40, at_8, running=8)["lookup"] > 0.6 * 40
    assert run(policy, 40, {"draft": 50.0, "lookup": 90.0, "plain": 100.0}, running=16)["plain"] > 0.6 * 40
    assert run(policy, 20, at_8, running=8)["lookup"] > 0.6 * 20


def test_a_high_load_level_tries_drafting_only_after_a_lower_one_measured_it():
    """A server started under heavy load runs the target alone until drafting's late first trial; at the
    lowest level it is tried at once, and once a lower level measured drafting, within a few windows."""
    rates = {"draft": 50.0, "lookup": 70.0, "plain": 100.0}
    high = LoadPolicy()
    high.observe(8, True, 10, 0.1)
    assert high.current == "plain"
    early = int(EXPLORE_WINDOWS) - 1
    assert run(high, early, rates, running=8)["draft"] == 0
    assert run(high, 10, rates, running=8)["draft"] >= 1  # then tried: drafting may pay on other hardware
    low = LoadPolicy()
    assert run(low, 3, rates, running=2)["draft"] >= 1
    assert run(low, 6, {**rates, "draft": 300.0}, running=8)["draft"] >= 2  # measured at 2: tried soon at 8


def test_the_tail_of_a_busy_period_runs_what_the_busy_level_ran():
    """The load falls from 8 requests to 4 before the busy level tried drafting: the new level starts on the
    busy level's best so far (plain steps), not on drafting, and tries drafting after a window."""
    rates = {"draft": 50.0, "lookup": 70.0, "plain": 100.0}
    policy = LoadPolicy()
    assert run(policy, 6, rates, running=8)["draft"] == 0
    assert policy.rate(8, "plain") is not None and policy.rate(8, "draft") is None
    steps = []
    for _ in range(WINDOW_STEPS):
        policy.observe(4, True, round(rates[policy.current] * 0.1), 0.1)
        steps.append(policy.current)
    assert policy._bucket == 4 and "draft" not in steps, steps
    assert run(policy, 4, rates, running=4)["draft"] >= 1  # then tried: drafting may pay at a lower load
