"""The proposer interface every drafter implements, and the per-request context it drafts from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .speculation_cache import CacheEntry


@dataclass(slots=True)
class DraftContext:
    """What the drafter knows of one request: the committed tokens (the last one is the anchor)."""

    req_id: str
    tokens: list[int]
    seed: int
    hidden: list[torch.Tensor] = field(default_factory=list)  # chunks of [positions, n_layers * hidden]
    last_block: list[int] = field(default_factory=list)  # drafts sent for the round being verified
    round: int = 0
    pipelined: bool = False  # pre-draft for expected outcomes while the target verifies
    temperature: float = 1.0  # the request's sampling temperature
    drafter_state: object = None  # the proposer's own per-request state (e.g. cached context K/V)

    def absorb(self, accepted: int, bonus: int, hidden: torch.Tensor | None) -> None:
        """Verification accepted the first `accepted` drafts of the last block and committed `bonus`."""
        self.tokens.extend(self.last_block[:accepted])
        self.tokens.append(bonus)
        if hidden is not None:
            self.hidden.append(hidden)
        self.last_block = []


class Proposer(Protocol):
    """Drafts up to `max_drafts` tokens to follow `ctx.tokens` (whose last token is the anchor)."""

    name: str
    hidden_layers: list[int]  # target hidden-state indices this proposer needs (empty: none)
    supports_foresight: bool

    def propose(self, ctx: DraftContext, max_drafts: int) -> list[int]: ...


class ForesightProposer(Proposer, Protocol):
    """A proposer that can pre-draft for the outcomes of the block under verification (pipelined mode)."""

    def foresee(self, ctx: DraftContext, block: list[int], max_drafts: int, budget_s: float) -> list[CacheEntry]:
        """While the target verifies `block` (drafted after `ctx.tokens`), pre-draft blocks for the
        outcomes (k, a) it expects, within about `budget_s` seconds of work (the last verify time)."""
        ...
