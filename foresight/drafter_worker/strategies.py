"""The drafting strategies one drafter worker offers, each a proposer.

A drafter loads one primary proposer (`make_proposer`): a draft model (with foresight when an adapter
comes with it) or prompt lookup. Around it the worker offers every strategy that costs no other model:

    sync       the primary proposer after each outcome (prompt lookup under --drafter ngram)
    pipelined  the primary with foresight (only when it supports it)
    hybrid     prompt lookup when the context repeats a long enough n-gram, else the draft model

The target chooses one per round (`Outcome.strategy`); "ar" (a plain step) and "ngram" (prompt lookup)
it runs without the drafter.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..protocol.kinds import Strategy
from .ngram import NgramProposer
from ..spec.ngram import lookup_match
from .proposer import Draft, DraftContext, Proposer


class HybridProposer:
    """Prompt lookup when the context ends in an n-gram of at least `min_match` tokens seen before (what
    follows it is then usually right, and costs nothing to draft), else the draft model. A view over the
    draft model's proposer: the per-request state is the model's (the worker adds and commits requests on the
    primary proposer only)."""

    name = "hybrid"
    supports_foresight = False

    def __init__(self, model: Proposer, ngram: NgramProposer, min_match: int):
        self.model = model
        self.ngram = ngram
        self.min_match = max(min_match, ngram.n_min)
        self.layout = model.layout

    def add_request(self, ctx: DraftContext) -> None:
        pass  # the model's state: see the class docstring

    def commit(self, ctx: DraftContext) -> None:
        pass

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        follow, n = lookup_match(ctx.tokens, max_drafts, self.ngram.n_max, self.min_match)
        if n >= self.min_match:
            return Draft(follow)  # prompt lookup gives no confidences
        return self.model.propose(ctx, max_drafts)

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
        """`propose` for several requests: lookup where it matches, the rest in one batch of the draft model."""
        drafts, rest = [], []
        for i, (ctx, wanted) in enumerate(zip(ctxs, max_drafts)):
            follow, n = lookup_match(ctx.tokens, wanted, self.ngram.n_max, self.min_match)
            drafts.append(Draft(follow) if n >= self.min_match else None)
            if drafts[-1] is None:
                rest.append(i)
        if rest:
            got = self.model.propose_batch([ctxs[i] for i in rest], [max_drafts[i] for i in rest])
            for i, draft in zip(rest, got):
                drafts[i] = draft
        return drafts


def auto_strategies(offered: dict[Strategy, Proposer]) -> list[Strategy]:
    """The drafting strategies mode `auto` chooses among (beside the target's own prompt lookup): every one offered,
    in `Strategy` order, but "sync" when it is prompt lookup (--drafter ngram), which the target runs faster
    itself, and "sync" when "hybrid" is offered: hybrid is sync plus lookup drafts on long matches, which cost no
    drafting time, and two close rivals would cost exploring without end (docs/journal/2026-12-07-control-layer.md)."""
    out = [s for s in Strategy if s in offered and not isinstance(offered[s], NgramProposer)]
    if Strategy.HYBRID in out:
        out.remove(Strategy.SYNC)
    return out


def offered_strategies(primary: Proposer, cfg: EngineConfig) -> dict[Strategy, Proposer]:
    """Strategy -> the proposer that drafts it, for every strategy this drafter can run. A new strategy is a
    `Strategy` member and its proposer here (tests/unit/test_new_strategy.py)."""
    out: dict[Strategy, Proposer] = {Strategy.SYNC: primary}
    if isinstance(primary, NgramProposer):
        return out
    out[Strategy.HYBRID] = HybridProposer(primary, NgramProposer(cfg.ngram_max, cfg.ngram_min), cfg.hybrid_min_match)
    if primary.supports_foresight:
        out[Strategy.PIPELINED] = primary
    return out
