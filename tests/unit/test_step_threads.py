"""The target borrows the drafter's threads exactly while the drafter has nothing to do."""
from __future__ import annotations

import torch

from foresight.config import EngineConfig
from foresight.control.round_planner import Hold
from foresight.protocol.messages import DraftBlock, GenerateRequest, SamplingParams
from foresight.target_worker.request_state import RequestState
from foresight.spec.sampling import PositionDraws
from foresight.target_worker.step_threads import StepThreads, drafter_busy, winding_down_only


def state(strategy: str, block: list[int] | None, prefilled: bool = True, drafting: bool = True) -> RequestState:
    s = RequestState(request=GenerateRequest(req_id="r", prompt_ids=[1, 2], max_tokens=4,
                                                   sampling=SamplingParams()), mode="auto",
                     draws=PositionDraws(0), drafting=drafting, strategy=strategy,
                     block=None if block is None else DraftBlock(req_id="r", round=0, tokens=block))
    s.prefill_pos = 2 if prefilled else 0
    return s


def test_the_drafter_is_busy_only_while_it_drafts_or_runs_foresight():
    assert not drafter_busy([])
    assert not drafter_busy([state("ngram", None), state("ar", None)])  # rounds the target runs alone
    assert drafter_busy([state("hybrid", None)])  # its block is being drafted
    assert not drafter_busy([state("hybrid", [5, 6])])  # block here: the drafter waits for the outcome
    assert not drafter_busy([state("sync", [5, 6])])
    assert drafter_busy([state("pipelined", [5, 6])])  # foresight runs beside the verification
    assert not drafter_busy([state("pipelined", [])])  # no drafts sent: no foresight for that block
    assert not drafter_busy([state("hybrid", None, prefilled=False)])  # no block asked for before prefill
    assert not drafter_busy([state("hybrid", None, drafting=False)])  # detached: the drafter is down
    assert drafter_busy([state("ngram", None), state("sync", None)])  # any request's drafting counts
    switched = state("ngram", None)
    switched.drafter_winding_down = 7  # the Outcome of round 7 switched away from pipelined: no DrafterIdle yet
    assert drafter_busy([switched])
    # Busy only by the switch: the target may wait a moment for DrafterIdle (DrafterLink.still_busy).
    assert winding_down_only([switched]) and winding_down_only([switched, state("hybrid", [5, 6])])
    assert not winding_down_only([switched, state("hybrid", None)])  # another request's block is being drafted
    assert not winding_down_only([state("ngram", None)])
    catching_up = state("ngram", None)
    catching_up.drafter_winding_down, catching_up.hold = 8, Hold.CATCH_UP_ASKED  # auto's catch-up before pipelined
    assert drafter_busy([catching_up])  # the drafter works for it, and takes its time: no wait for it
    assert not winding_down_only([catching_up]) and not winding_down_only([switched, catching_up])


def test_step_threads_borrow_the_drafters_share_and_switch_only_on_change(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = StepThreads(own=1, borrowable=2)
    assert threads.use(drafter_busy=False) == 3 and threads.use(drafter_busy=False) == 3 == threads.most
    assert threads.use(drafter_busy=True) == 1
    assert calls == [3, 1]
    assert StepThreads.from_config(EngineConfig(drafter_threads=2)).borrowable == 2
    assert StepThreads.from_config(EngineConfig(borrow_drafter_threads=False)).borrowable == 0
    assert StepThreads.from_config(EngineConfig(drafter_device="cuda:1")).borrowable == 0  # not the CPU's cores
    assert StepThreads.from_config(EngineConfig(target_cores="0", drafter_cores="1")).borrowable == 0  # pinned apart
