"""The round planner decides each round's strategy in one place, in order: the load policy, the catch-up hold, the
request's own strategy; and its figures are what the api exports (ControllerStats)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from foresight.control.round_planner import CATCH_UP_MIN, Hold, RoundPlanner
from foresight.control.strategy_choice import RequestChoice
from foresight.protocol.kinds import Mode, Strategy


@dataclass
class Planned:
    """The planning fields of a request's state (`PlannedRequest`)."""

    mode: Mode
    strategy: Strategy = Strategy.AR
    choice: RequestChoice | None = None
    drafting: bool = True
    hold: Hold = Hold.NONE
    foreseen: int = 0
    round_cost_s: float = 0.05
    positions: int = 10


def planner() -> RoundPlanner:
    return RoundPlanner((Strategy.PIPELINED,), hybrid_min_match=3, batching=True)


def test_a_fixed_mode_runs_its_strategy_and_auto_its_choice():
    p = planner()
    sync = Planned(Mode.SYNC)
    p.start(sync, 0.0, [1, 2, 3])
    assert sync.choice is None and p.next_strategy(sync, None, [1, 2, 3]) == Strategy.SYNC
    auto = Planned(Mode.AUTO)
    p.start(auto, 0.0, [1, 2, 3])
    assert auto.choice is not None and auto.choice.group == "greedy"
    assert p.next_strategy(auto, None, [1, 2, 3]) == auto.choice.current
    alone = Planned(Mode.AUTO, drafting=False)  # no drafter: auto has the target's prompt lookup left
    p.start(alone, 0.0, [1, 2, 3])
    assert alone.choice is None and alone.strategy == Strategy.NGRAM


def test_the_load_policy_comes_first():
    p = planner()
    p.policy.current = "lookup"  # under load the target runs alone
    auto, sync = Planned(Mode.AUTO), Planned(Mode.SYNC)
    p.start(auto, 0.0, [1, 2, 3])
    assert p.next_strategy(auto, None, [1, 2, 3]) == Strategy.NGRAM and auto.hold == Hold.LOAD
    assert p.next_strategy(sync, None, [1, 2, 3]) == Strategy.AR and sync.hold == Hold.LOAD
    p.policy.current = "draft"
    assert p.next_strategy(sync, 2, [1, 2, 3, 4]) == Strategy.SYNC and sync.hold == Hold.NONE


def test_a_switch_to_pipelined_is_held_on_lookup_until_the_drafter_caught_up():
    p = planner()
    state = Planned(Mode.AUTO, strategy=Strategy.NGRAM, positions=CATCH_UP_MIN + 5)
    state.choice = RequestChoice(group="greedy", current=Strategy.PIPELINED)
    assert p.next_strategy(state, None, [1, 2, 3]) == Strategy.NGRAM and state.hold == Hold.CATCH_UP_DUE
    state.hold = Hold.CATCH_UP_ASKED  # the worker sent the catch-up's Outcome
    assert p.next_strategy(state, 1, [1, 2, 3, 4]) == Strategy.NGRAM and state.hold == Hold.CATCH_UP_ASKED
    state.hold = Hold.CATCH_UP_DONE  # its DrafterIdle came: the next round pipelines
    assert p.next_strategy(state, 1, [1, 2, 3, 4, 5]) == Strategy.PIPELINED and state.hold == Hold.NONE
    state.strategy, state.foreseen = Strategy.NGRAM, state.positions - 1  # little to catch up on: no hold
    assert RoundPlanner.catch_up_hold(state) == Hold.NONE


def test_a_load_hold_replaces_a_catch_up_and_is_not_charged_to_the_trial():
    p = planner()
    state = Planned(Mode.AUTO, strategy=Strategy.NGRAM, positions=CATCH_UP_MIN + 5)
    state.choice = RequestChoice(group="greedy", current=Strategy.PIPELINED)
    state.hold = Hold.CATCH_UP_ASKED
    p.policy.current = "lookup"
    charged = []
    p.chooser.observe_held = lambda *args: charged.append(args)
    assert p.next_strategy(state, 1, [1, 2, 3]) == Strategy.NGRAM and state.hold == Hold.LOAD
    assert p.next_strategy(state, 1, [1, 2, 3, 4]) == Strategy.NGRAM and state.hold == Hold.LOAD
    assert len(charged) == 1  # the catch-up round is the trial's cost; the rounds load held are not
    p.policy.current = "draft"  # load gone: the catch-up is asked again, being still due
    assert p.next_strategy(state, 1, [1, 2, 3, 4, 5]) == Strategy.NGRAM and state.hold == Hold.CATCH_UP_DUE


def test_its_figures_are_the_controllers():
    p = planner()
    assert p.stats().auto_goodput == {} and p.stats().policy == "draft"
    state = Planned(Mode.AUTO)
    p.start(state, 0.0, [1, 2, 3])
    for _ in range(12):  # rounds of whatever auto chooses: each measured one feeds the class's figures
        state.strategy = p.next_strategy(state, 3, [1, 2, 3, 4, 5])
    stats = p.stats()
    assert set(stats.auto_goodput) == {"greedy/ngram", "greedy/pipelined"}
    assert all(rate == pytest.approx(3 / 0.05) for rate in stats.auto_goodput.values())
    for _ in range(40):  # two requests' steps: a load level, and the policy's first windows
        p.committed(2)
        p.step_done([Mode.AUTO, Mode.AUTO])
    stats = p.stats()
    assert stats.load_level == 2 and stats.policy_goodput and all(k.startswith("2/") for k in stats.policy_goodput)
