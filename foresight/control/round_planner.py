"""What each round of each request runs, decided in one place for one target worker.

Three controllers have a say, in this order of precedence:
    the load policy   under load, whether rounds may wait for the drafter at all (`load_policy.py`);
    the catch-up hold mode auto's switch to "pipelined" first runs prompt lookup while the drafter's adapter
                      and decoder take in the positions they missed (`RoundPlanner.catch_up_hold`);
    the chooser       mode auto's strategy by measured goodput (`strategy_choice.py`); a fixed mode runs its own.
How many drafts a round verifies is the verify-length controller's (`verify_length.py`): the target's for its
own prompt lookup, the drafter's for the blocks it drafts (it sees its drafts' confidences).

The planner also keeps what those controllers measure with: each request's share of a batched step
(`step_cost.py`), and the tokens and seconds of every step for the load policy. `stats` is what Prometheus
shows of them (`ControllerStats`).

The planner reads and writes the planning fields of the target's per-request state (`PlannedRequest`).
"""
from __future__ import annotations

import enum
import time
from typing import Iterable, Protocol

from ..protocol.kinds import Mode, Strategy
from ..protocol.messages import ControllerStats
from .load_policy import LoadPolicy
from .step_cost import StepCost
from .strategy_choice import RequestChoice, StrategyChooser, request_group, round_context

# Mode auto switching to "pipelined" with at least this many positions its adapter and decoder have not taken
# in runs prompt lookup until the drafter has caught up on them (`catch_up_hold`); fewer, the first
# foresight job takes them within its round (fp32, 2-core CPU: 16 positions of the 15-layer decoder ~40 ms).
CATCH_UP_MIN = 16


class Hold(enum.Enum):
    """Why a request's current round does not run its own strategy (one at a time: the load policy comes first)."""

    NONE = "none"  # it runs its own strategy
    LOAD = "load"  # the load policy holds it to the target alone
    CATCH_UP_DUE = "catch_up_due"  # prompt lookup; this round's Outcome asks the drafter to catch up
    CATCH_UP_ASKED = "catch_up_asked"  # prompt lookup until the DrafterIdle of that Outcome
    CATCH_UP_DONE = "catch_up_done"  # answered: the round after this one pipelines

    @property
    def catching_up(self) -> bool:
        return self in (Hold.CATCH_UP_DUE, Hold.CATCH_UP_ASKED, Hold.CATCH_UP_DONE)


class PlannedRequest(Protocol):
    """The fields of a request's state the planner reads (`target_worker.request_state.RequestState`)."""

    mode: Mode
    strategy: Strategy  # how the current round runs
    choice: RequestChoice | None  # mode auto: its side of the strategy choice
    drafting: bool  # the drafter holds its context
    hold: Hold  # why the current round does not run its own strategy
    foreseen: int  # positions the drafter's adapter and decoder have taken in
    round_cost_s: float  # the target's time the round just verified consumed
    positions: int


class RoundPlanner:
    def __init__(self, auto_strategies: tuple[Strategy, ...], hybrid_min_match: int, batching: bool):
        """`auto_strategies`: the drafter's strategies mode auto picks from (besides local prompt lookup);
        `batching`: requests share forwards (only then is there a load to plan for)."""
        self.chooser = StrategyChooser((Strategy.NGRAM, *auto_strategies))
        self.policy = LoadPolicy() if batching else None
        self.step_cost = StepCost()
        self.min_match = hybrid_min_match
        self.step_tokens, self.step_ended = 0, time.perf_counter()  # tokens committed in the step; its end

    # ------------------------------------------------------------------ requests

    def start(self, state: PlannedRequest, temperature: float, tokens: list[int]) -> None:
        """The request's prompt is in and its first token committed (`tokens`: prompt + that token): mode auto's
        first strategy. Without the drafter, auto has one strategy left, the target's own prompt lookup."""
        if state.mode != Mode.AUTO:
            return
        if state.drafting:
            state.choice = self.chooser.start(request_group(temperature), self.context(tokens))
        else:
            state.strategy = Strategy.NGRAM

    def next_strategy(self, state: PlannedRequest, committed: int | None, tokens: list[int]) -> Strategy:
        """The strategy of the request's next round; in mode auto, after measuring the round that just
        committed `committed` tokens (None: the prefill, which is not a round). `tokens`: prompt + output."""
        if state.choice is not None and committed is not None:
            if state.hold == Hold.NONE:  # it ran the request's own strategy
                self.chooser.observe(state.choice, committed, state.round_cost_s)
                self.chooser.advance(state.choice, self.context(tokens))
            elif state.hold.catching_up:  # a trial's catch-up costs it
                self.chooser.observe_held(state.choice, committed, state.round_cost_s)
        if self.policy is not None and self.policy.local:  # under load the target does better alone
            state.hold = Hold.LOAD
            return self.policy.held_strategy(state.mode)
        state.hold = self.catch_up_hold(state)
        if state.hold != Hold.NONE:
            return Strategy.NGRAM
        return state.choice.current if state.choice is not None else Strategy(state.mode)

    @staticmethod
    def catch_up_hold(state: PlannedRequest) -> Hold:
        """Does auto's switch to "pipelined" wait for the drafter to catch up? Its adapter and decoder have not
        taken in the positions committed since the request's last pipelined round (the prompt, rounds of
        other strategies): the first foresight job would, taking a 15-layer decoder over them, and the round
        after it would wait (it made each pipelined trial cost auto several rounds of lookup). So the request
        asks for the catch-up (`Outcome.catch_up`) and runs prompt lookup, unmeasured, until the drafter's
        DrafterIdle. A load hold forgets a catch-up in progress; afterwards it is asked again if still due."""
        if state.choice is None or state.choice.current != Strategy.PIPELINED:
            return Hold.NONE
        if state.hold == Hold.CATCH_UP_ASKED:
            return Hold.CATCH_UP_ASKED  # not answered yet
        if state.hold.catching_up:
            return Hold.NONE  # answered: the first foresight job takes in what the rounds meanwhile committed
        due = state.strategy != Strategy.PIPELINED and state.positions - state.foreseen >= CATCH_UP_MIN
        return Hold.CATCH_UP_DUE if due else Hold.NONE

    def context(self, tokens: list[int]) -> str:
        """Mode auto's context of the round after `tokens` (strategy_choice.py)."""
        return round_context(tokens, self.min_match)

    # ------------------------------------------------------------------ steps

    def forward_done(self, positions: int, seconds: float) -> None:
        """A forward fed `positions` and took `seconds` (the step-cost fit's data)."""
        self.step_cost.observe(positions, seconds)

    def shares(self, lengths: list[int], seconds: float) -> list[float]:
        """A forward fed `lengths[b]` positions for row b and took `seconds`: each row's part of it."""
        self.forward_done(sum(lengths), seconds)
        return self.step_cost.shares(lengths, seconds)

    def committed(self, tokens: int) -> None:
        self.step_tokens += tokens

    def step_done(self, modes: Iterable[Mode]) -> None:
        """A target step ended with requests of `modes` running: tell the load policy what it (and the idle time
        before it) committed."""
        now = time.perf_counter()
        if self.policy is not None:
            modes = list(modes)
            contested = any(m != Mode.AR for m in modes)  # else every policy is plain steps
            self.policy.observe(len(modes), contested, self.step_tokens, now - self.step_ended)
        self.step_tokens, self.step_ended = 0, now

    # ------------------------------------------------------------------ what Prometheus shows

    def stats(self) -> ControllerStats:
        """The controllers' current figures: auto's pooled goodput per class and strategy, the load policy's per
        load level and policy, the policy running now and the load level it counts for."""
        goodput = {f"{group}/{s}": rate for group in ("greedy", "sampled")
                   for s, pooled in self.chooser.pooled.get(group, {}).items() if (rate := pooled.rate) is not None}
        exploring = {group: self.chooser.exploring_cost(group) for group in self.chooser.rounds}
        policy = self.policy
        return ControllerStats(
            auto_goodput=goodput, auto_exploring=exploring,
            policy=policy.current if policy is not None else "",
            load_level=policy.level if policy is not None else 0,
            policy_goodput={f"{level}/{p}": r.rate for (level, p), r in policy.rates.items() if r.rate is not None}
            if policy is not None else {})
