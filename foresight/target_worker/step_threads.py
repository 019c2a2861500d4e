"""How many intra-op threads the target's next step runs on.

On a CPU the two workers split the cores: the target's `--target-threads`, the drafter's
`--drafter-threads`. The drafter's cores idle whenever it has nothing to do: in rounds the target runs
alone (plain steps, prompt lookup), and in a sync or hybrid round while the target verifies (the drafter
then waits for the outcome). A step in such a moment runs on both shares; only while the drafter drafts a
block or runs foresight (pipelined: it pre-drafts during the verification) does the target keep to its own.
What the second share buys, and that switching the count between steps costs nothing measurable: `scripts/
step_threads.py`, docs/journal/2026-11-30-mode-auto.md.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..config import EngineConfig
from ..control.round_planner import Hold
from ..protocol.kinds import Strategy
from .request_state import RequestState


def _drafting_for(s: RequestState) -> bool:
    """Is the drafter drafting a block this request waits for, or running foresight beside its pipelined
    verification (its block arrived; foresight runs until the outcome)? A pipelined block without drafts
    queues no foresight (the verify-length controller chose a plain step): the drafter idles."""
    foresight = s.strategy == Strategy.PIPELINED and s.block is not None and bool(s.block.tokens)
    return s.prefilled and s.awaits_block() and (s.block is None or foresight)


def drafter_busy(states: Iterable[RequestState]) -> bool:
    """Is the drafter drafting or running foresight for some request (`_drafting_for`), or not yet done with
    a request that switched to a round the target runs alone (no DrafterIdle yet: a foresight stage may
    still run)?"""
    return any(s.drafter_winding_down or _drafting_for(s) for s in states)


def winding_down_only(states: Iterable[RequestState]) -> bool:
    """Is the drafter busy only because a request switched to a round the target runs alone, with its
    DrafterIdle on the way? (After a sync or hybrid round the drafter answers at once; not so after a
    catch-up, which takes its time.)"""
    states = list(states)
    return any(s.drafter_winding_down and s.hold != Hold.CATCH_UP_ASKED for s in states) \
        and not any(_drafting_for(s) or s.hold == Hold.CATCH_UP_ASKED for s in states)


class StepThreads:
    """Sets torch's intra-op thread count per step, changing it only when the count changes."""

    def __init__(self, own: int, borrowable: int):
        self.own = own
        self.borrowable = borrowable
        self.current = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "StepThreads":
        both_cpu = cfg.target_device == "cpu" and cfg.drafter_device == "cpu"
        # Pinned workers keep to their own cores: a borrowed thread would run on the target's cores anyway.
        borrow = cfg.borrow_drafter_threads and both_cpu and not cfg.pinned
        return cls(cfg.target_threads, cfg.drafter_threads if borrow else 0)

    @property
    def most(self) -> int:
        """The most threads a step runs on (the target's own and the drafter's borrowed)."""
        return self.own + self.borrowable

    def use(self, drafter_busy: bool) -> int:
        """Threads for the next step: the target's own while the drafter works, else both shares."""
        n = self.own if drafter_busy else self.most
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
        return n
