"""The proposer interface every drafter implements, and the per-request context it drafts from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..protocol.messages import SamplingParams
from .speculation_cache import CacheEntry


@dataclass(slots=True)
class DraftContext:
    """What the drafter knows of one request: the committed tokens (the last one is the anchor)."""

    req_id: str
    tokens: list[int]
    seed: int
    # Target-state chunks [positions, n_layers * hidden] not yet absorbed by the proposer. A proposer
    # that absorbs them into its own context clears the list (see `pending_hidden`), so a long request does
    # not keep every state twice.
    hidden: list[torch.Tensor] = field(default_factory=list)
    last_block: list[int] = field(default_factory=list)  # drafts sent for the round being verified
    # The proposer's top-1 probability of each token of its last proposal (empty: none given); the worker
    # keeps it aligned with `last_block` once the block is sent.
    last_confidence: list[float] = field(default_factory=list)
    round: int = 0
    pipelined: bool = False  # this round's strategy pre-drafts for expected outcomes while the target verifies
    proposer: str = ""  # name of the proposer that drafted `last_block` (its verify-length statistics)
    temperature: float = 1.0  # the request's sampling temperature
    sampling: SamplingParams | None = None  # the request's top-k, top-p and verification rule (foresight scores)
    refinement: str | None = None  # the request's self-refinement mode (StartDraft); None = the drafter's
    drafter_state: object = None  # the proposer's own per-request state (e.g. cached context K/V)

    def absorb(self, accepted: int, bonus: int, hidden: torch.Tensor | None) -> None:
        """Verification accepted the first `accepted` drafts of the last block and committed `bonus`."""
        self.tokens.extend(self.last_block[:accepted])
        self.tokens.append(bonus)
        if hidden is not None:
            self.hidden.append(hidden)
        self.last_block = []
        self.last_confidence = []

    def pending_hidden(self) -> torch.Tensor | None:
        """The target states not yet absorbed, as one tensor [n, n_layers * hidden] (None: none).
        The proposer calls `hidden.clear()` once it has absorbed them (not before: a failed absorb
        must leave them for the next try)."""
        if not self.hidden:
            return None
        return torch.cat(self.hidden) if len(self.hidden) > 1 else self.hidden[0]


class Proposer(Protocol):
    """Drafts up to `max_drafts` tokens to follow `ctx.tokens` (whose last token is the anchor)."""

    name: str
    hidden_layers: list[int]  # target hidden-state indices this proposer needs (empty: none)
    supports_foresight: bool

    def propose(self, ctx: DraftContext, max_drafts: int) -> list[int]: ...


class ForesightProposer(Proposer, Protocol):
    """A proposer that can pre-draft for the outcomes of the block under verification (pipelined mode)."""

    def foresee(self, ctx: DraftContext, block: list[int], max_drafts: int, budget_s: float,
                stop: Callable[[], bool] | None = None) -> list[CacheEntry]:
        """While the target verifies `block` (drafted after `ctx.tokens`), pre-draft blocks for the
        outcomes (k, a) it expects, within about `budget_s` seconds of work (the last verify time). `stop()`
        true (a message waits) ends the work early with what is ready (possibly nothing)."""
        ...
