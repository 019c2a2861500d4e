"""The proposer contract every drafter implements, and the per-request context it drafts from.

A proposer owns its per-request state (a draft model's context K/V, a foresight drafter's adapter and
decoder caches): `add_request` when the target starts a request (its prompt's target states are in the
context), `propose` after each outcome, `foresee` while the target verifies (pipelined), `release` when the
request ends. `DraftContext` is the round's bookkeeping the worker keeps and every strategy of the request
reads: committed tokens, target states no proposer has absorbed yet, the block in flight.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from ..protocol.kinds import Refinement
from ..protocol.messages import HiddenLayout, LinearStates, SamplingParams
from .speculation_cache import CacheEntry


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposal: draft tokens and the proposer's top-1 probability of each (the verify-length
    controller's acceptance evidence; empty when the proposer gives none, e.g. prompt lookup)."""

    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.confidence and len(self.confidence) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens with {len(self.confidence)} confidences")

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> "Draft":
        """The first `n` drafts (a prefix of a block is a valid block)."""
        return Draft(self.tokens[:n], self.confidence[:n])


@dataclass(slots=True)
class DraftContext:
    """What the drafter knows of one request: the committed tokens (the last one is the anchor)."""

    req_id: str
    tokens: list[int]
    seed: int
    # Target-state chunks [positions, layout.width] not yet absorbed by the proposer. A proposer
    # that absorbs them into its own context clears the list (see `pending_hidden`), so a long request does
    # not keep every state twice.
    hidden: list[torch.Tensor] = field(default_factory=list)
    last_block: Draft = field(default_factory=Draft)  # the block sent for the round being verified
    round: int = 0
    pipelined: bool = False  # this round's strategy pre-drafts for expected outcomes while the target verifies
    proposer: str = ""  # name of the proposer that drafted `last_block` (its verify-length statistics)
    temperature: float = 1.0  # the request's sampling temperature
    sampling: SamplingParams | None = None  # the request's top-k, top-p and verification rule (foresight scores)
    refinement: Refinement | None = None  # the request's self-refinement (StartDraft); None = the drafter's
    # Hybrid targets: the newest committed linear-attention state the target sent (`layout.state_layers`)
    linear_states: LinearStates | None = None

    def absorb(self, accepted: int, bonus: int, hidden: torch.Tensor | None,
               linear_states: LinearStates | None = None) -> None:
        """Verification accepted the first `accepted` drafts of the last block and committed `bonus`."""
        self.tokens.extend(self.last_block.tokens[:accepted])
        self.tokens.append(bonus)
        if hidden is not None:
            self.hidden.append(hidden)
        if linear_states is not None:
            self.linear_states = linear_states
        self.last_block = Draft()

    def pending_hidden(self) -> torch.Tensor | None:
        """The target states not yet absorbed, as one tensor [n, layout.width] (None: none).
        The proposer calls `hidden.clear()` once it has absorbed them (not before: a failed absorb
        must leave them for the next try)."""
        if not self.hidden:
            return None
        return torch.cat(self.hidden) if len(self.hidden) > 1 else self.hidden[0]


class Proposer(Protocol):
    """Drafts up to `max_drafts` tokens to follow `ctx.tokens` (whose last token is the anchor)."""

    name: str
    layout: HiddenLayout  # the target states it reads, and their columns (no layers: none)
    supports_foresight: bool

    def add_request(self, ctx: DraftContext) -> None:
        """A new request whose prompt is `ctx.tokens` (target states in `ctx.hidden`): set up its state."""
        ...

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft: ...

    def release(self, req_id: str) -> None:
        """The request ended: drop its state."""
        ...


class ForesightProposer(Proposer, Protocol):
    """A proposer that can pre-draft for the outcomes of the block under verification (pipelined mode)."""

    def foresee(self, ctx: DraftContext, block: list[int], max_drafts: int, budget_s: float,
                stop: Callable[[], bool] | None = None, confidence: Sequence[float] = ()) -> list[CacheEntry]:
        """While the target verifies `block` (drafted after `ctx.tokens`, with the proposer's `confidence`
        in each token if it gave one), pre-draft blocks for the outcomes (k, a) it expects, within about
        `budget_s` seconds of work (the last verify time). `stop()` true (a message waits) ends the work
        early with what is ready (possibly nothing)."""
        ...

    # Optional: `foresee_batch(ctxs, blocks, max_drafts, budget_s, stop, confidences)`, `foresee` for several
    # requests at once (one list of entries per request); the worker then runs every queued job in one call.


class StatelessProposer:
    """A proposer that keeps nothing per request (prompt lookup, scripted test proposers)."""

    layout = HiddenLayout()  # reads no target states

    def add_request(self, ctx: DraftContext) -> None:
        pass

    def release(self, req_id: str) -> None:
        pass
