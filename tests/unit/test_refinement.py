"""Self-refinement of pre-drafted blocks (JetSpec++ section 4.3) and the per-round plan (Eq. 3).

With the oracle adapter (the target's TRUE states) the decoder is the perfect one, so a context refresh
sees exactly the target's greedy token at every position of a draft: anchor replacement must write it at
the first disagreement and keep the agreeing prefix. Whatever refinement does, the pipelined engine must
stay lossless.
"""
from __future__ import annotations

import argparse
import itertools
import json

import pytest
import torch

from foresight.bench.harness import Run, request_for_run, refinement_runs, refinement_section, ModeTally
from foresight.config import ConfigError, EngineConfig, add_engine_args, engine_from_args
from foresight.drafter_worker.budget import Plan, StepCosts, plan_round
from foresight.control.costs import RunningCost
from foresight.models.draft_model import ContextKV, draw_noise
from foresight.drafter_worker.proposer import DraftContext
from foresight.drafter_worker.refinement import Refiner
from foresight.protocol import decode, encode
from foresight.protocol.kinds import Refinement
from foresight.protocol.messages import GenerateRequest, RequestFailed, SamplingParams, StartDraft, TokenOutput
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB
from test_foresight import GAMMA, NEW, PROMPTS, greedy_outcome, make_drafter, true_states

torch.set_num_threads(1)
M = 6  # drafts per pre-drafted block


@pytest.fixture(scope="module")
def target():
    from support.tiny_models import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def sequences(target):
    from support.tiny_models import plain_greedy

    return [p + plain_greedy(target, p, NEW, eos=target.config.eos_token_id) for p in PROMPTS]


REQUEST_IDS = itertools.count()


def start(target, sequences, drafter, cls=DraftContext, **kw):
    """A new request after its prompt and one committed token: (ctx, state, block under verification)."""
    seq, p = sequences[0], len(PROMPTS[0])
    truth = true_states(target, seq, drafter.layout.layers)
    ctx = cls(req_id=f"r{next(REQUEST_IDS)}", tokens=seq[:p + 1], seed=3, hidden=[truth[:p]], **kw)
    block = seq[p + 1:p + 1 + GAMMA]
    block[2] = (block[2] + 1) % VOCAB  # verification of this block ends at k = 2
    return ctx, drafter.absorb(ctx), block


@torch.inference_mode()
def target_guesses(target, tokens: list[int]) -> list[int]:
    """The target's greedy token after every prefix of `tokens`."""
    return target(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


# ---------------------------------------------------------------- the plan (Eq. 3)


def costs_of(predict: float, per_row_pass: float, per_row_refresh: float | None = None, fixed: float = 0.0,
             rows: int = 6) -> StepCosts:
    """Costs measured at batch sizes 1..rows: pass(B) = fixed + B * per_row_pass (refresh likewise)."""
    costs = StepCosts(predict=RunningCost(predict))
    for n in range(1, rows + 1):
        costs.passes.observe(n, fixed + n * per_row_pass)
        if per_row_refresh is not None:
            costs.refreshes.observe(n, fixed + n * per_row_refresh)
    return costs


def test_plan_without_budget_or_measurement_is_the_caps():
    assert plan_round(StepCosts(), 0.05, 4, 3, 2) == Plan(4, 3, 2)  # nothing measured yet
    assert plan_round(costs_of(0.001, 0.001, 0.002), 0.0, 4, 3, 9) == Plan(4, 3, 3)  # no budget; R <= J
    with pytest.raises(ValueError):
        plan_round(StepCosts(), 0.0, 0, 1, 1)


@pytest.mark.parametrize("fixed", [0.0, 0.003])
@pytest.mark.parametrize("budget_ms", [0.5, 3, 7, 10, 13, 20, 40, 1000])
def test_plan_fits_the_budget_and_respects_the_caps(budget_ms, fixed):
    costs = costs_of(0.002, 0.001, 0.0015, fixed)
    plan = plan_round(costs, budget_ms / 1e3, 4, 3, 2)
    assert 1 <= plan.outcomes <= 4 and 0 <= plan.refreshes <= min(plan.passes, 2) and plan.passes <= 3
    b = plan.outcomes
    work = costs.predict_s + (1 + plan.passes) * costs.pass_s(b) + plan.refreshes * costs.refresh_s(b)
    if plan.outcomes > 1 or plan.passes:
        assert work <= budget_ms / 1e3 + 1e-12
    # Maximal: one more pass (with or without a refresh) would not fit or would break a cap, and so
    # would one more outcome with the same passes.
    assert plan.passes == 3 or work + costs.pass_s(b) > budget_ms / 1e3
    if b < 4:
        assert costs.predict_s + costs.pass_s(b + 1) > budget_ms / 1e3


def test_plan_puts_outcomes_first_then_refresh_pass_pairs():
    costs = costs_of(0.002, 0.001, 0.002)
    assert plan_round(costs, 0.004, 4, 3, 3) == Plan(2, 0, 0)  # (4-2)/1 ms: two outcomes with J0
    assert plan_round(costs, 0.006, 4, 3, 3) == Plan(4, 0, 0)
    assert plan_round(costs, 0.018, 4, 3, 3) == Plan(4, 1, 1)  # 2 + 4 (J0) + 12 (refresh + pass)
    assert plan_round(costs, 0.018, 4, 3, 0) == Plan(4, 3, 0)  # no refreshes allowed: plain passes
    assert plan_round(costs, 0.030, 4, 3, 3) == Plan(4, 2, 2)
    assert plan_round(costs, 0.034, 4, 3, 3) == Plan(4, 3, 2)  # a third pair does not fit, a plain pass does
    # No refresh measured yet: assumed to cost one prediction (2 ms for the batch), so pairs cost 6 ms.
    assert plan_round(costs_of(0.002, 0.001), 0.018, 4, 3, 3) == Plan(4, 2, 2)


def test_plan_with_flat_batch_costs_drafts_all_outcomes_and_spends_the_rest_on_passes():
    """Where a batch of rows costs what one row does (weight reads dominate), a per-row model would
    draft one outcome; measured by batch size, the plan drafts the cap and still makes room for passes."""
    costs = costs_of(0.080, 0.0, fixed=0.023, rows=1)  # only B = 1 measured: 23 ms
    costs.passes.observe(4, 0.025)
    assert plan_round(costs, 0.125, 4, 1, 0) == Plan(4, 0, 0)  # 80 + 25 = 105; a pass more would not fit
    assert plan_round(costs, 0.135, 4, 1, 0) == Plan(4, 1, 0)


def test_a_passed_up_refresh_pair_falls_back_to_a_plain_pass():
    costs = costs_of(0.001, 0.001, 0.01)
    assert plan_round(costs, 0.004, 1, 3, 3) == Plan(1, 2, 0)


# ---------------------------------------------------------------- refresh and anchor replacement


@pytest.mark.parametrize("mode", ["anchor", "refresh"])
def test_refresh_finds_the_first_disagreement_with_the_target(target, sequences, mode):
    """Row 0: the realised outcome, drafted as the target's continuation with x_3 wrong; row 1: the same
    outcome drafted exactly right; row 2: another outcome with a random draft."""
    drafter = make_drafter(target, sequences)
    ctx, state, block = start(target, sequences, drafter)
    n, seq = len(ctx.tokens) - 1, sequences[0]
    k, a = greedy_outcome(target, ctx.tokens, block)
    assert k == 2
    truth = seq[n + k + 2:n + k + 2 + M]  # the target's continuation after that outcome
    wrong = list(truth)
    wrong[2] = (wrong[2] + 1) % VOCAB
    g = torch.Generator().manual_seed(1)
    other = torch.randint(0, VOCAB, (M,), generator=g).tolist()
    outcomes = [(k, a), (k, a), (0, (block[0] + 3) % VOCAB)]
    drafts = torch.tensor([wrong, truth, other])
    ref = Refiner(drafter.scorer.bound_rows(state, n), ctx.tokens[-1], block, outcomes, drafts, mode)
    ref.refresh([0, 1, 2])
    assert ref.refreshes == [1, 1, 1] and ref.passes == [0, 0, 0]
    # Row 0: x_1, x_2 agree; the target's x_3 is written (anchor) or x_3 is left to redraft (refresh).
    if mode == "anchor":
        assert ref.fixed[0] == 3 and ref.drafts[0].tolist() == truth[:3] + wrong[3:]
    else:
        assert ref.fixed[0] == 2 and ref.drafts[0].tolist() == wrong
    assert ref.fixed[1] == M and ref.drafts[1].tolist() == truth  # no disagreement: all fixed
    assert ref.open_rows() == [0, 2]
    # Row 2: against the target's greedy tokens after its own outcome, found by a plain forward.
    prefix = ctx.tokens + block[:0] + [outcomes[2][1]]
    top = target_guesses(target, prefix + other)[len(prefix) - 1:len(prefix) - 1 + M]
    i = next(j for j in range(M) if top[j] != other[j])
    assert ref.fixed[2] == (i + 1 if mode == "anchor" else i)
    expect = other[:i] + [top[i]] + other[i + 1:] if mode == "anchor" else other
    assert ref.drafts[2].tolist() == expect
    # The refreshed states are the target's true states of [y0, d_1..d_k, a, x] (the oracle), in the
    # draft model's source order.
    row0 = ctx.tokens[:-1] + [ctx.tokens[-1], *block[:k], a] + wrong
    assert torch.allclose(ref.states[0], true_states(target, row0, [1, 3])[n:], atol=1e-4)


def test_fixed_positions_never_change_in_later_passes(target, sequences):
    drafter = make_drafter(target, sequences, cache_size=4)
    ctx, state, block = start(target, sequences, drafter)
    n = len(ctx.tokens) - 1
    pred, logits, normed = drafter.predict(ctx, block)
    outcomes = [(o.k, o.a) for o in drafter.select(logits, block, 4, 0.0)]
    noise = torch.randint(0, VOCAB, (4, M - 1), generator=torch.Generator().manual_seed(2))
    drafts, _ = drafter.scorer.draft_outcomes(state, n, drafter.scorer.draft_states(pred, normed), outcomes, noise, 0)
    ref = Refiner(drafter.scorer.bound_rows(state, n), ctx.tokens[-1], block, outcomes, drafts, "anchor")
    history = []
    for step in range(M):
        rows = ref.open_rows()
        if not rows:
            break
        ref.refresh(rows)
        before = ref.drafts.clone()
        fixed = list(ref.fixed)
        tail = ref.open_rows()
        if tail:
            ref.redraft(tail)
        for b in range(4):
            assert torch.equal(ref.drafts[b, :fixed[b]], before[b, :fixed[b]]), (step, b)
        history.append((fixed, ref.drafts.clone()))
    for (f0, d0), (f1, d1) in zip(history, history[1:]):
        assert all(x <= y for x, y in zip(f0, f1))  # fixed prefixes only grow
        for b in range(4):
            assert torch.equal(d0[b, :f0[b]], d1[b, :f0[b]])
    assert ref.open_rows() == []  # each refresh fixes at least one position: M refreshes fix everything
    # With the perfect decoder every row ends as the target's greedy continuation after its outcome.
    for b, (k, a) in enumerate(outcomes):
        prefix = ctx.tokens + block[:k] + [a]
        top = target_guesses(target, prefix + ref.drafts[b].tolist())[len(prefix) - 1:len(prefix) - 1 + M]
        assert ref.drafts[b].tolist() == top
    assert all(p <= r for p, r in zip(ref.passes, ref.refreshes))  # a pass only after a refresh here


def test_a_refresh_pass_of_an_unfixed_row_is_a_jacobi_pass(target, sequences):
    """Nothing fixed (the first draft token is wrong, mode "refresh"): the pass after the refresh reads the
    same states as the batched draft, so it equals one more Jacobi pass."""
    drafter = make_drafter(target, sequences)
    ctx, state, block = start(target, sequences, drafter)
    n = len(ctx.tokens) - 1
    pred, _, normed = drafter.predict(ctx, block)
    states = drafter.scorer.draft_states(pred, normed)
    outcomes = [(2, 7), (0, 9)]
    noise = torch.randint(0, VOCAB, (2, M - 1), generator=torch.Generator().manual_seed(4))
    j0, _ = drafter.scorer.draft_outcomes(state, n, states, outcomes, noise, 0)
    j1, _ = drafter.scorer.draft_outcomes(state, n, states, outcomes, noise, 1)
    ref = Refiner(drafter.scorer.bound_rows(state, n), ctx.tokens[-1], block, outcomes, j0, "refresh")
    ref.refresh([0, 1])
    rows = [b for b in ref.open_rows() if ref.fixed[b] == 0]
    assert rows, "a random draft model should disagree with the target at once"
    ref.redraft(rows)
    for b in rows:
        assert ref.drafts[b].tolist() == j1[b].tolist()


# ---------------------------------------------------------------- foresee


def old_foresee(drafter, ctx, block, passes):
    """The drafting before refinement existed: J0 + `passes` over the picked outcomes, contexts built by hand."""
    state = drafter.absorb(ctx)
    n = len(ctx.tokens) - 1
    pred, logits, normed = drafter.predict(ctx, block)
    picked = drafter.select(logits, block, drafter.cache_size, ctx.temperature)
    noise = torch.stack([draw_noise(ctx.tokens + block[:o.k] + [o.a], M - 1, state.model.generator) for o in picked])
    model = drafter.model
    proj = model.project_context(drafter.scorer.draft_states(pred, normed)[None])
    positions = torch.arange(n, n + proj.shape[1])
    keys, values = model.context_kv(proj, positions[None])
    base, contexts = state.draft, []
    for o in picked:
        ks = [torch.cat([x, y[0, :o.k + 1]]) for x, y in zip(base.keys, keys)]
        vs = [torch.cat([x, y[0, :o.k + 1]]) for x, y in zip(base.values, values)]
        contexts.append(ContextKV(ks, vs, torch.cat([base.positions, positions[:o.k + 1]]), proj[0, o.k]))
    anchors = torch.tensor([o.a for o in picked])
    return [(o.k, o.a, tuple(d)) for o, d in zip(picked, model.draft(contexts, anchors, noise, passes)[-1].tolist())]


def test_mode_none_is_the_old_drafting(target, sequences):
    ref = make_drafter(target, sequences, foresight_passes=2, cache_size=3)
    ctx, _, block = start(target, sequences, ref)
    expect = old_foresee(ref, ctx, block, 2)
    for kw, cls, ctx_kw in [(dict(refinement="none"), DraftContext, {}),
                            (dict(refreshes=0), DraftContext, {}),  # anchor mode, no refresh allowed
                            ({}, DraftContext, dict(refinement="none"))]:  # the request's mode wins
        drafter = make_drafter(target, sequences, foresight_passes=2, cache_size=3, use_budget=False, **kw)
        c, _, _ = start(target, sequences, drafter, cls, **ctx_kw)
        entries = drafter.foresee(c, block, M, budget_s=0.0)
        assert [(e.accepted, e.bonus, e.tokens) for e in entries] == expect, kw
        assert all(e.passes == 2 and e.refreshes == 0 for e in entries)
        assert drafter.scorer.adapter.predict_calls == 1  # no refresh ran
        # Unrefined entries carry the draft model's confidence for the verify-length controller.
        assert all(len(e.confidence) == len(e.tokens) and all(0 < c <= 1 for c in e.confidence) for e in entries)


def test_foresee_refines_and_counts_what_it_spent(target, sequences):
    drafter = make_drafter(target, sequences, foresight_passes=3, cache_size=3, refreshes=2, use_budget=False,
                           temperature=0.0)
    ctx, _, block = start(target, sequences, drafter)
    entries = drafter.foresee(ctx, block, M, budget_s=0.0)
    assert drafter.stats.plan == Plan(3, 3, 2) and drafter.stats.mode == "anchor"
    assert drafter.scorer.adapter.predict_calls >= 2  # the foresight prediction + at least one refresh
    for e in entries:  # J - R = 1 plain pass, then up to 2 x (refresh, pass) while the row has open positions
        assert 1 <= e.refreshes <= 2 and 1 <= e.passes <= 1 + e.refreshes and len(e.tokens) == M
        assert e.confidence == ()  # refined tokens are not the draft model's: no confidence to report
    assert drafter.costs.refresh_s(3) > 0 and drafter.costs.pass_s(3) > 0 and drafter.costs.predict_s > 0
    # The realised outcome at temperature 0 comes first; perfect refreshes make its block the target's.
    seq, n = sequences[0], len(ctx.tokens) - 1
    k, a = greedy_outcome(target, ctx.tokens, block)
    assert (entries[0].accepted, entries[0].bonus) == (k, a)
    assert list(entries[0].tokens[:entries[0].refreshes]) == seq[n + k + 2:n + k + 2 + entries[0].refreshes]
    c, _, _ = start(target, sequences, drafter, refinement="bogus")
    with pytest.raises(ValueError, match="refinement"):
        drafter.foresee(c, block, M, budget_s=0.0)


def test_a_waiting_message_stops_foresight_between_stages(target, sequences):
    """`stop()` true ends the job at the next stage boundary: before drafting nothing is cached, after the
    first pass the drafts as they stand (valid blocks, fewer refreshes than planned)."""
    drafter = make_drafter(target, sequences, foresight_passes=3, cache_size=3, refreshes=2, use_budget=False,
                           temperature=0.0)
    ctx, _, block = start(target, sequences, drafter)
    assert drafter.foresee(ctx, block, M, budget_s=0.0, stop=lambda: True) == []
    asked = []
    ctx, _, block = start(target, sequences, drafter)
    before = drafter.scorer.adapter.predict_calls

    def after_first_refresh() -> bool:  # a message arrives while the first refresh runs
        asked.append(drafter.scorer.adapter.predict_calls)
        return drafter.scorer.adapter.predict_calls - before >= 2  # the foresight prediction, then one refresh

    entries = drafter.foresee(ctx, block, M, budget_s=0.0, stop=after_first_refresh)
    assert entries and drafter.scorer.adapter.predict_calls - before == 2  # no refresh after the interruption
    assert all(e.refreshes <= 1 and len(e.tokens) == M for e in entries)
    assert any(e.refreshes == 1 and e.passes == 1 for e in entries), "the pass after the refresh still ran"
    assert len(asked) >= 2


def test_the_drafter_worker_sees_a_waiting_message(target, sequences):
    import time

    import zmq

    from foresight.config import EngineConfig
    from foresight.drafter_worker.worker import DrafterWorker
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.messages import ReleaseDraft
    from foresight.protocol.sockets import MessageSocket

    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        worker = DrafterWorker(EngineConfig(drafter="ngram"), addrs, make_drafter(target, sequences), zctx)
        assert not worker.message_waiting()
        push = MessageSocket(zctx, zmq.PUSH, addrs.target_to_drafter, bind=False)
        push.send(ReleaseDraft(req_id="x"))
        for _ in range(200):  # the message crosses the socket asynchronously
            if worker.message_waiting():
                break
            time.sleep(0.01)
        assert worker.message_waiting()
        assert isinstance(worker.recv_from_target.recv(timeout_ms=0), ReleaseDraft)  # still there to handle
    finally:
        zctx.destroy(linger=0)
        addrs.remove()


# ---------------------------------------------------------------- end to end


@pytest.mark.parametrize("mode", Refinement.values())
def test_pipelined_greedy_is_lossless_with_each_mode(target, sequences, mode, tmp_path):
    drafter = make_drafter(target, sequences, foresight_passes=2, cache_size=2, temperature=0.0,
                           refinement=mode, use_budget=False)
    log = tmp_path / "rounds.jsonl"
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1, round_log=str(log)),
                             proposer=drafter, foresight_to_completion=True)
    try:
        rounds = []
        for prompt, seq in zip(PROMPTS, sequences):
            got = engine.generate(prompt, NEW, mode="pipelined", temperature=0.0)
            assert got["error"] is None
            assert got["tokens"] == seq[len(prompt):]
            rounds += got["rounds"]
    finally:
        engine.close()
    hits = [r for r in rounds if r.cache_hit]
    assert hits
    refreshes = sum(r.refreshes for r in hits)
    assert refreshes == 0 if mode == "none" else refreshes > 0
    assert all(r.passes <= 2 and r.refreshes <= 2 for r in hits)
    if mode == "anchor":  # the perfect decoder's tokens are the target's: accepted (the random drafts never are)
        assert sum(r.accepted for r in hits) > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # the round log splits each job's time
    done = [line for line in lines if line["job"] == "done" and line["predicted"]]  # [] : nothing was asked for
    assert done and all(0 < line["predict_ms"] and 0 < line["draft_ms"] <= line["foresight_ms"] for line in done)


def test_the_request_mode_travels_to_the_drafter(target, sequences):
    """GenerateRequest.refinement -> StartDraft.refinement -> the drafter's per-request context; a bad one
    cannot be built (nor decoded: test_protocol)."""
    drafter = make_drafter(target, sequences, foresight_passes=1, cache_size=2, temperature=0.0, use_budget=False)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    seen = []
    on_start = engine.drafter.handlers[StartDraft]

    def record(msg: StartDraft) -> None:
        on_start(msg)
        seen.append(engine.drafter.contexts[msg.req_id].refinement)  # what the worker gave the context

    engine.drafter.handlers[StartDraft] = record
    try:
        outs = {}
        for rid, value in [("a", "none"), ("b", None)]:
            engine.send_to_target.send(GenerateRequest(req_id=rid, prompt_ids=PROMPTS[0], max_tokens=20,
                                                       sampling=SamplingParams(temperature=0.0), mode="pipelined",
                                                       refinement=value))
            outs[rid] = collect(engine, rid)
    finally:
        engine.close()
    assert seen == ["none", None] and seen[0] is Refinement.NONE
    with pytest.raises(ValueError, match="refinement must be one of none, refresh, anchor"):
        GenerateRequest(req_id="c", prompt_ids=PROMPTS[0], max_tokens=20, sampling=SamplingParams(),
                        refinement="sideways")
    assert all(r.refreshes == 0 for r in outs["a"]) and sum(r.refreshes for r in outs["b"]) > 0


def collect(engine, rid):
    rounds = []
    while True:
        msg = engine.recv_from_workers.recv(timeout_ms=60000)
        assert msg is not None
        if isinstance(msg, RequestFailed) and msg.req_id == rid:
            return msg
        if isinstance(msg, TokenOutput) and msg.req_id == rid:
            rounds += msg.rounds
            if msg.finished:
                return rounds


def test_refinement_fields_round_trip_and_default_to_none():
    req = GenerateRequest(req_id="r", prompt_ids=[1], max_tokens=2, sampling=SamplingParams(), refinement="refresh")
    assert decode(encode(req)) == req
    start_msg = StartDraft(req_id="r", prompt_ids=[1], seed=0, refinement="anchor")
    assert decode(encode(start_msg)).refinement == "anchor"
    assert StartDraft(req_id="r", prompt_ids=[1], seed=0).refinement is None
    with pytest.raises(ConfigError, match="refinement"):
        EngineConfig(refinement="sideways")
    with pytest.raises(ConfigError, match="draft_refreshes"):
        EngineConfig(draft_refreshes=-1)


# ---------------------------------------------------------------- bench


def test_bench_plans_one_pipelined_run_per_refinement_mode():
    cfg = EngineConfig()
    runs = refinement_runs(argparse.Namespace(refinement_ablation="none, anchor,none"), cfg)
    assert [(r.mode, r.refinement) for r in runs] == [("pipelined", "none"), ("pipelined", "anchor")]
    assert refinement_runs(argparse.Namespace(refinement_ablation=""), cfg) == []
    with pytest.raises(ConfigError):
        refinement_runs(argparse.Namespace(refinement_ablation="none,all"), cfg)
    req = GenerateRequest(req_id="x", prompt_ids=[1], max_tokens=4, sampling=SamplingParams())
    assert request_for_run(req, runs[1], "0").refinement == "anchor"
    tally = ModeTally(output_tokens=10, wall_s=1.0, rounds=4, committed=10, lookups=4, hits=2,
                      outputs=[[1, 2]], predrafted=2, passes=3, refreshes=2)
    section = refinement_section([Run("p", "pipelined", "exact", 0.95, "anchor")], {"p": tally}, [[1, 2]])
    assert section["anchor"] == {"tau": 2.5, "hit_rate": 0.5, "tokens_per_s": 10.0, "exposed_draft_ms_mean": None,
                                 "outputs_match_ar": 1.0, "passes_mean": 1.5, "refreshes_mean": 1.0}


def test_foresight_budget_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_from_args(parser.parse_args([])).foresight_budget is True
    assert engine_from_args(parser.parse_args(["--no-foresight-budget"])).foresight_budget is False


def test_foresight_passes_flag_caps_the_pipelined_passes_apart_from_sync():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_from_args(parser.parse_args([])).foresight_passes == 3  # the budget picks how many run
    assert engine_from_args(parser.parse_args(["--foresight-passes", "1"])).foresight_passes == 1
    with pytest.raises(ConfigError, match="foresight_passes"):
        engine_from_args(parser.parse_args(["--foresight-passes", "-1"]))
