"""Mode auto end to end on tiny models (fp32), both worker loops over real sockets: switching strategies
round by round never changes greedy output, and auto leaves a proposer that stops paying."""
from __future__ import annotations

import time

from foresight.spec.sampling import PositionDraws
from foresight.config import EngineConfig
from foresight.drafter_worker.proposer import Draft, StatelessProposer
from foresight.control import strategy_choice
from foresight.control.strategy_choice import StrategyChooser
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model
from test_foresight import PROMPTS, make_drafter


class ScriptedProposer(StatelessProposer):
    """Drafts the true greedy continuation (set by the test) while `paying`; afterwards wrong tokens, slowly:
    a draft model that stopped fitting the workload."""

    name = "scripted"
    supports_foresight = False

    def __init__(self, vocab: int, delay_s: float = 0.03):
        self.truth: list[int] = []  # prompt + greedy continuation of the request being served
        self.paying = True
        self.vocab = vocab
        self.delay_s = delay_s

    def propose(self, ctx, max_drafts: int) -> Draft:
        n = len(ctx.tokens)
        right = self.truth[n:n + max_drafts]
        if self.paying:
            return Draft(right)
        time.sleep(self.delay_s)
        return Draft([(t + 1) % self.vocab for t in right])


def served_rounds(results: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for stats in results["rounds"]:
        out[stats.strategy] = out.get(stats.strategy, 0) + 1
    return out


def share(rounds: dict[str, int], *strategies: str) -> float:
    return sum(rounds.get(s, 0) for s in strategies) / max(1, sum(rounds.values()))


def test_auto_leaves_a_proposer_that_stops_paying():
    model = tiny_model("llama")
    proposer = ScriptedProposer(model.config.vocab_size)
    # verify_length="max": every sync round drafts and verifies the whole block, so a proposer that stopped
    # paying costs its wrong drafts and its delay in every round; under "auto" the verify-length controller
    # may stop drafting instead, and sync rounds then tie with plain steps, decided by timing noise.
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=8, verify_length="max"),
                             proposer=proposer)
    prompt = [3, 17, 60, 61, 62]
    want = plain_greedy(model, prompt, 64)
    proposer.truth = prompt + want
    try:
        assert engine.target.planner.chooser.strategies == ("ngram", "hybrid")
        # The tiny model's greedy text repeats itself, so prompt lookup would pay as well as the scripted
        # drafts: choose between plain steps and the scripted proposer alone, the test is about the latter.
        engine.target.planner.chooser = StrategyChooser(("ar", "sync"))

        def serve() -> dict[str, int]:
            got = engine.generate(prompt, 64, mode="auto", temperature=0.0, seed=0)
            assert got["error"] is None and got["tokens"] == want
            return served_rounds(got)

        paying = [serve() for _ in range(3)]
        assert share(paying[-1], "sync") > 0.7, paying
        proposer.paying = False
        stopped = [serve() for _ in range(4)]
        # The first request after the change pays for noticing it; the later ones run plain steps. Pooled over
        # three requests: a noisy stretch of plain rounds (a busy CI machine) can hand one request a few dozen
        # sync rounds, because sync's pooled figures still hold its paying rounds (8 tokens each).
        later = {s: sum(r.get(s, 0) for r in stopped[1:]) for s in ("ar", "sync")}
        assert share(later, "ar") > 0.8, stopped
    finally:
        engine.close()


def test_auto_switching_every_few_rounds_keeps_greedy_output(monkeypatch):
    """Trials every few rounds make auto hop between all its strategies; output stays plain greedy.
    (Sampled output: every strategy only changes the drafts, and verification is lossless for any drafts,
    tested in test_verification.py.)"""
    monkeypatch.setattr(strategy_choice, "EXPLORE_ROUNDS", 1.0)
    model = tiny_model("llama")
    seqs = [p + plain_greedy(model, p, 24, eos=model.config.eos_token_id) for p in PROMPTS]
    drafter = make_drafter(model, seqs)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=drafter)
    try:
        assert engine.target.planner.chooser.strategies == ("ngram", "pipelined", "hybrid")
        used: dict[str, int] = {}
        for prompt in PROMPTS:
            auto = engine.generate(prompt, 40, mode="auto", temperature=0.0)
            assert auto["error"] is None
            assert auto["tokens"] == plain_greedy(model, prompt, 40, eos=model.config.eos_token_id)
            for s, n in served_rounds(auto).items():
                used[s] = used.get(s, 0) + n
        assert set(used) == {"pipelined", "ngram", "hybrid"}, used
    finally:
        engine.close()


def test_prompt_lookup_runs_in_the_target_and_keeps_greedy_output():
    """Mode ngram drafts in the target: no block from the drafter (no exposed drafting), drafts verified on a
    repetitive prompt, output plain greedy."""
    model = tiny_model("llama")
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6))
    try:
        for prompt in PROMPTS:
            got = engine.generate(prompt, 40, mode="ngram", temperature=0.0)
            assert got["tokens"] == plain_greedy(model, prompt, 40, eos=model.config.eos_token_id)
            assert all(r.strategy == "ngram" and r.exposed_draft_s is None for r in got["rounds"])
            assert sum(r.drafted for r in got["rounds"]) > 0
        bad = engine.generate(PROMPTS[0], 5, mode="hybrid", temperature=0.0)
        assert "not offered" in bad["error"]
    finally:
        engine.close()


def test_offered_and_auto_strategies():
    from foresight.drafter_worker.ngram import NgramProposer
    from foresight.drafter_worker.strategies import auto_strategies, offered_strategies

    cfg = EngineConfig(drafter="ngram")
    lookup = NgramProposer(4, 2)
    assert offered_strategies(lookup, cfg) == {"sync": lookup} and auto_strategies({"sync": lookup}) == []
    model = ScriptedProposer(96)
    offered = offered_strategies(model, cfg)
    assert set(offered) == {"sync", "hybrid"} and auto_strategies(offered) == ["hybrid"]


def test_the_drafter_absorbs_a_prompt_when_the_request_starts():
    """The prompt's target states go into the draft model at StartDraft, not in the first round that asks
    for a block (in auto that round may come late, and must not pay for the prompt)."""
    import zmq

    from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
    from foresight.drafter_worker.worker import DrafterWorker
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.messages import ReleaseDraft, StartDraft
    from test_foresight import make_draft_model, true_states

    model = tiny_model("llama")
    proposer = JetSpecProposer(make_draft_model(model), passes=1)
    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        worker = DrafterWorker(EngineConfig(drafter="ngram"), addrs, proposer, zctx)
        prompt = PROMPTS[0]
        hidden = true_states(model, prompt, proposer.layout.layers)  # [prompt_len, n_layers * hidden]
        worker.on_start(StartDraft(req_id="r", prompt_ids=prompt, seed=0, hidden=hidden))
        ctx = worker.contexts["r"]
        assert ctx.hidden == [] and proposer.state(ctx).positions == len(prompt)
        worker.on_release(ReleaseDraft(req_id="r"))
        assert "r" not in worker.contexts  # and with it the proposer's state of the request
    finally:
        zctx.destroy(linger=0)
        addrs.remove()


def test_the_drafter_answers_a_switch_to_a_target_round_with_drafter_idle():
    """An Outcome opening an "ngram" round gets DrafterIdle once the drafter has handled it (its foresight
    stopped): only then do the target's steps borrow the drafter's threads."""
    import zmq

    from foresight.drafter_worker.worker import DrafterWorker
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.messages import DrafterIdle, Outcome, StartDraft
    from foresight.protocol.sockets import MessageSocket
    from support.oracle_proposer import OracleForesight

    model = tiny_model("llama")
    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        from_drafter = MessageSocket(zctx, zmq.PULL, addrs.drafter_to_target, bind=True)
        worker = DrafterWorker(EngineConfig(drafter="ngram"), addrs, OracleForesight(model), zctx)
        worker.on_start(StartDraft(req_id="r", prompt_ids=PROMPTS[0], seed=0))
        worker.on_outcome(Outcome(req_id="r", round=1, accepted=0, bonus=5, max_drafts=4, strategy="pipelined"))
        assert from_drafter.recv(timeout_ms=5000).round == 1  # the block
        worker.on_outcome(Outcome(req_id="r", round=2, accepted=1, bonus=6, max_drafts=4, strategy="ngram"))
        idle = from_drafter.recv(timeout_ms=5000)
        assert isinstance(idle, DrafterIdle) and (idle.req_id, idle.round) == ("r", 2)
    finally:
        zctx.destroy(linger=0)
        addrs.remove()


def test_a_catch_up_is_answered_with_drafter_idle_once_done():
    """An Outcome with `catch_up` (auto about to switch to pipelined) is answered only after the drafter's
    adapter and decoder have taken in every committed state, which it does when no message waits."""
    import zmq

    from foresight.drafter_worker.worker import DrafterWorker
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.messages import DrafterIdle, Outcome, StartDraft
    from foresight.protocol.sockets import MessageSocket
    from test_foresight import true_states

    model = tiny_model("llama")
    prompt = PROMPTS[0]
    drafter = make_drafter(model, [prompt + plain_greedy(model, prompt, 8)])
    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        from_drafter = MessageSocket(zctx, zmq.PULL, addrs.drafter_to_target, bind=True)
        worker = DrafterWorker(EngineConfig(drafter="ngram"), addrs, drafter, zctx)
        hidden = true_states(model, prompt, drafter.layout.layers)  # [prompt_len, layout.width]
        worker.on_start(StartDraft(req_id="r", prompt_ids=prompt, seed=0, hidden=hidden))
        state = drafter.state(worker.contexts["r"])
        worker.on_outcome(Outcome(req_id="r", round=1, accepted=0, bonus=5, max_drafts=4, strategy="ngram",
                                  drafts=[], catch_up=True))
        assert from_drafter.recv(timeout_ms=100) is None and state.decoder.length == 0  # not done yet
        worker.run_catch_up()
        idle = from_drafter.recv(timeout_ms=5000)
        assert isinstance(idle, DrafterIdle) and (idle.req_id, idle.round) == ("r", 1)
        assert state.scored == state.decoder.length == len(prompt) and not worker.catch_ups
    finally:
        zctx.destroy(linger=0)
        addrs.remove()


def test_a_switch_to_pipelined_runs_prompt_lookup_while_the_drafter_catches_up(monkeypatch):
    """Auto's switch to pipelined (here at once: its only strategy) first has the drafter catch up on the
    positions its adapter and decoder have not taken in (the prompt), and runs prompt lookup until the
    drafter says it is done: no pipelined round waits for the catch-up. Greedy output stays plain greedy."""
    from foresight.control import round_planner

    monkeypatch.setattr(round_planner, "CATCH_UP_MIN", 4)
    model = tiny_model("llama")
    prompt = PROMPTS[1]
    # Long enough that prompt lookup (which lands whole blocks on this repetitive model) cannot finish the
    # request before the slowed catch-up does.
    new_tokens = 120
    drafter = make_drafter(model, [prompt + plain_greedy(model, prompt, new_tokens, eos=model.config.eos_token_id)])
    caught_up_at: list[int] = []  # context positions in the decoder after each finished catch-up
    catch_up = drafter.catch_up

    def slow_catch_up(ctx, stop) -> bool:
        time.sleep(0.005)  # the target runs a round or two meanwhile
        done = catch_up(ctx, stop)
        caught_up_at.append(drafter.state(ctx).decoder.length)
        return done

    drafter.catch_up = slow_catch_up
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=drafter)
    try:
        engine.target.planner.chooser = StrategyChooser(("pipelined",))
        engine.generate(prompt, 4, mode="sync", temperature=0.0)  # the drafter's socket is connected by now
        got = engine.generate(prompt, new_tokens, mode="auto", temperature=0.0)
        assert got["error"] is None
        assert got["tokens"] == plain_greedy(model, prompt, new_tokens, eos=model.config.eos_token_id)
        order = [stats.strategy for stats in got["rounds"]]
        first = order.index("pipelined")
        assert first > 0 and set(order[:first]) == {"ngram"} and set(order[first:]) == {"pipelined"}, order
        assert caught_up_at and caught_up_at[0] >= len(prompt)
    finally:
        engine.close()


def test_a_switch_waits_a_moment_for_drafter_idle_before_borrowing():
    """After a switch to a round the target runs alone, the next step waits (briefly) for the drafter's
    DrafterIdle: it arrives within a millisecond after a hybrid round, and the step then runs on the
    drafter's threads too. Without an answer the wait is bounded and the step keeps its own threads."""
    import zmq

    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.messages import DrafterIdle, GenerateRequest, SamplingParams
    from foresight.protocol.sockets import MessageSocket
    from foresight.target_worker.request_state import RequestState
    from foresight.target_worker.runner import TargetRunner
    from foresight.target_worker.step_threads import StepThreads
    from foresight.target_worker.drafter_link import WIND_DOWN_WAIT_MS
    from foresight.target_worker.worker import TargetWorker

    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    worker = TargetWorker(EngineConfig(drafter="ngram"), addrs, TargetRunner(tiny_model("llama")), zctx,
                          eos_token_ids=[], max_model_len=256, threads=StepThreads(own=1, borrowable=1))
    try:
        to_target = MessageSocket(zctx, zmq.PUSH, addrs.drafter_to_target, bind=False)
        request = GenerateRequest(req_id="r", prompt_ids=[1, 2], max_tokens=8, sampling=SamplingParams())
        state = RequestState(request=request, mode="auto", draws=PositionDraws(0), drafting=True,
                             strategy="ngram")
        state.cache, state.round, state.drafter_winding_down = object(), 4, 4
        worker.requests["r"] = state
        t0 = time.perf_counter()
        assert worker.link.still_busy(worker.threads.borrowable)  # no answer: the step keeps its own threads ...
        assert time.perf_counter() - t0 < 1.0 and state.drafter_winding_down == 4  # ... after a bounded wait
        assert WIND_DOWN_WAIT_MS <= 5
        to_target.send(DrafterIdle(req_id="r", round=4))
        time.sleep(0.05)  # it is in the target's queue, not yet handled: the loop drained before it came
        assert not worker.link.still_busy(worker.threads.borrowable) and state.drafter_winding_down == 0
    finally:
        zctx.destroy(linger=0)
        addrs.remove()
