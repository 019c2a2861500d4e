"""The proposer contract every drafter implements, and the per-request context it drafts from.

`DraftContext` is the one object the drafter keeps per request, released by dropping it: the committed tokens,
target states the proposer has not taken yet, the block in flight, the blocks pre-drafted for the next round,
and each proposer's own state for the request (a draft model's context K/V, a foresight drafter's adapter and
decoder caches: `DraftContext.states`, keyed by the proposer). The proposer is told `add_request` when the
target starts a request (its prompt's target states are in the context), `commit` after each outcome (the
round's tokens and target states are committed in the context), `propose` when a round wants a block,
`propose_batch` for several requests' blocks at once, `foresee` (`foresee_batch`) while the target verifies
(pipelined).

A proposer takes the committed target states out of the context in `commit`, but runs its models over them
only when it next drafts (`propose`, `foresee`): `commit` runs before the worker answers the outcome, and a
forward there would delay a pre-drafted block the target waits for (a pipelined cache hit), or run beside a
target step that borrowed the drafter's threads (an outcome that opens an "ar" or "ngram" round), while a
round that wants a fresh block absorbs them first thing anyway. States `commit` could not take stay in the
context, and the next draft takes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..protocol.kinds import Refinement
from ..protocol.messages import HiddenLayout, LinearStates, SamplingParams
from .speculation_cache import CacheEntry, ForeseenBlocks


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
    # Committed target-state chunks [positions, layout.width], oldest first, that the proposer has not taken
    # yet (`take_hidden`: in `commit`, else when it next drafts), so a long request does not keep every state
    # twice.
    hidden: list[torch.Tensor] = field(default_factory=list)
    last_block: Draft = field(default_factory=Draft)  # the block sent for the round being verified
    round: int = 0
    pipelined: bool = False  # this round's strategy pre-drafts for expected outcomes while the target verifies
    proposer: str = ""  # name of the proposer that drafted `last_block` (its verify-length statistics)
    temperature: float = 1.0  # the request's sampling temperature
    sampling: SamplingParams | None = None  # the request's top-k, top-p and verification rule (foresight scores)
    banned: frozenset[int] = frozenset()  # tokens its logit bias bans: every block sent ends before them
    refinement: Refinement | None = None  # the request's self-refinement (StartDraft); None = the drafter's
    # Hybrid targets: the newest committed linear-attention state the target sent (`layout.state_layers`)
    linear_states: LinearStates | None = None
    foreseen: ForeseenBlocks = field(default_factory=ForeseenBlocks)  # pre-drafted for the next round (pipelined)
    # Each proposer's own state for the request, created by the proposer on first use under its key.
    states: dict[str, Any] = field(default_factory=dict)

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

    def take_hidden(self) -> list[torch.Tensor]:
        """The target-state chunks not taken yet, oldest first; the proposer keeps them from now on (it must
        keep them until its models have absorbed them: a failed absorb retries with them)."""
        chunks, self.hidden = self.hidden, []
        return chunks


class Proposer(Protocol):
    """Drafts up to `max_drafts` tokens to follow `ctx.tokens` (whose last token is the anchor)."""

    name: str
    layout: HiddenLayout  # the target states it reads, and their columns (no layers: none)
    supports_foresight: bool

    def add_request(self, ctx: DraftContext) -> None:
        """A new request whose prompt is `ctx.tokens` (target states in `ctx.hidden`): set up its state."""
        ...

    def commit(self, ctx: DraftContext) -> None:
        """An outcome committed tokens (`ctx.tokens`) and their target states (`ctx.hidden`, `ctx.linear_states`):
        take the states over, without model work (see the module docstring)."""
        ...

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        """A block after `ctx.tokens`; first absorbs the committed states not absorbed yet, `ctx.hidden`'s too
        (a `commit` that failed or was not called)."""
        ...

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
        """`propose` for several requests, as one batch where the proposer can (`propose_each`: one by one)."""
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

    def foresee_batch(self, ctxs: list[DraftContext], blocks: list[list[int]], max_drafts: list[int],
                      budget_s: float, stop: Callable[[], bool] | None = None,
                      confidences: Sequence[Sequence[float]] | None = None) -> list[list[CacheEntry]]:
        """`foresee` for several requests whose blocks one target step verifies (one list of entries per request;
        none where `max_drafts` is 0): the worker runs every queued job in one call."""
        ...

    def catch_up(self, ctx: DraftContext, stop: Callable[[], bool]) -> bool:
        """Run every model foresight reads over the committed states not absorbed yet, pausing between passes
        when `stop()` is true; True when done (the worker calls it again until then)."""
        ...


def propose_each(proposer: Proposer, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
    """`propose_batch` of a proposer that drafts one request at a time."""
    return [proposer.propose(ctx, n) for ctx, n in zip(ctxs, max_drafts)]


def foresee_each(proposer: ForesightProposer, ctxs: list[DraftContext], blocks: list[list[int]],
                 max_drafts: list[int], budget_s: float, stop: Callable[[], bool] | None = None,
                 confidences: Sequence[Sequence[float]] | None = None) -> list[list[CacheEntry]]:
    """`foresee_batch` of a proposer that pre-drafts one request at a time."""
    confidences = confidences if confidences is not None else [()] * len(ctxs)
    return [proposer.foresee(ctx, block, n, budget_s, stop, conf) if n > 0 else []
            for ctx, block, n, conf in zip(ctxs, blocks, max_drafts, confidences)]


class StatelessProposer:
    """A proposer that keeps nothing per request (prompt lookup, scripted test proposers)."""

    layout = HiddenLayout()  # reads no target states

    def add_request(self, ctx: DraftContext) -> None:
        pass

    def commit(self, ctx: DraftContext) -> None:
        pass

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
        return propose_each(self, ctxs, max_drafts)
