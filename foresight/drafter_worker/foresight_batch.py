"""The foresight round (steps 1-5 of foresight.py) for one request or several at once.

`ForesightDrafter` runs every round through `foresee_batch`; `foresee` is its one-request case. With
several requests (the pipelined jobs a batched target step queues together), each expensive stage takes
one pass for all of them:

    absorb      per request: the round's new target states into the draft model's and the adapter's
                contexts and the decoder's pending list
    predict     one adapter pass over every request's [anchor, block] (`Adapter.predict_many`: contexts
                right-padded and masked, positions per row) and one decoder pass
                (`ForesightDecoder.logits_and_hidden_many`), which also takes each request's pending context
                states into its cache
    select      per request: its plan (B, J, R from the budget, `ForesightDrafter.plan`) and its B outcomes
    draft       one draft-model batch over the outcome rows of every request (J0, then J - R passes); each
                request draws its noise from its own generator, and its rows take its own plan's pass
    refine      per request (`Refiner`): R refreshes, each followed by a pass

So each request gets the entries `foresee` gives it alone, up to float rounding. The measured costs the
plans read are the batch's: the prediction's time, and a batched pass by its rows. `stop()` (a message
waits) ends the whole batch between stages: before drafting no request gets entries, after it every
request its drafts as they stand.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..models.draft_model import draw_noise
from ..protocol.kinds import Refinement
from .budget import Plan
from .outcomes import Outcome
from .proposer import DraftContext
from .refinement import Refiner
from .speculation_cache import CacheEntry

if TYPE_CHECKING:
    from .outcome_scorer import ForesightState

__all__ = ["BatchedForesight", "ForesightStats", "passes_run"]


@dataclass(slots=True)
class ForesightStats:
    """The last foresight call, for benchmarks and tests."""

    outcomes: int = 0  # B drafted
    predict_s: float | None = None  # adapter + decoder + scoring (None: the call ended before)
    draft_s: float | None = None  # selecting the outcomes, their draft (J0 + J) and refreshes (None: not reached)
    total_s: float = 0.0
    plan: Plan | None = None  # the round's plan (B, J, R caps); rows may spend less (a batch: its first request's)
    mode: str = ""  # the refinement mode used (a batch: its first request's)
    requests: int = 1  # requests drafted in the call (`foresee_batch`)


class BatchedForesight:
    """The round of `ForesightDrafter` (its base class), which provides `absorb`, `predict_blocks` (steps 1-2),
    `plan`, `select`, `lags`, `catch_up`, the `scorer` (its draft rows), and `model`, `costs`, `temperature`,
    `refinement`, `refines`, `stats`."""

    def foresee(self, ctx: DraftContext, block: list[int], max_drafts: int, budget_s: float,
                stop: Callable[[], bool] | None = None, confidence: Sequence[float] = ()) -> list[CacheEntry]:
        """Steps 1-5 for `block` (`confidence`: the draft model's probability of each of its tokens): the
        one-request case of `foresee_batch`. `stop`: asked between stages whether a message waits (an
        outcome, or any other request's message); then the job ends at once: before drafting it returns
        nothing, after it the drafts as they stand (every pass and refresh leaves a valid block)."""
        return self.foresee_batch([ctx], [block], [max_drafts], budget_s, stop, [confidence])[0]

    def foresee_batch(self, ctxs: list[DraftContext], blocks: list[list[int]], max_drafts: list[int],
                      budget_s: float, stop: Callable[[], bool] | None = None,
                      confidences: Sequence[Sequence[float]] | None = None) -> list[list[CacheEntry]]:
        """Steps 1-5 for several requests whose blocks the target verifies, each expensive stage in one pass
        for all of them: the scorer's pass (`predict_blocks`), then the drafts of every request's outcomes in
        one draft-model batch; selection and refinement run per request. -> per request what `foresee` gives it alone, up to float rounding (each request draws its
        noise from its own generator). B, J and R are planned per request (`plan`) from the measured costs,
        which the batch updates: its prediction time, its batched passes by their rows. `stop` ends the
        whole batch: before drafting nothing for any request, after it the drafts as they stand."""
        stop = stop or (lambda: False)
        confidences = list(confidences) if confidences is not None else [()] * len(ctxs)
        out: list[list[CacheEntry]] = [[] for _ in ctxs]
        t0 = time.perf_counter()
        parts = []
        for i, (ctx, block, wanted, confidence) in enumerate(zip(ctxs, blocks, max_drafts, confidences)):
            if wanted <= 0:
                continue
            # The request's refinement, else the engine's (none where nothing can refresh a draft).
            mode = Refinement.parse(ctx.refinement or self.refinement, "refinement") if self.refines else Refinement.NONE
            if self.lags(ctx):
                caught_at = time.perf_counter()
                if not self.catch_up(ctx, stop):
                    return out  # a message waits: the passes done stay done, the next job goes on from there
                t0 += time.perf_counter() - caught_at  # a one-off (a new prompt), not what predicting costs
            state = self.absorb(ctx)
            if state.draft is not None:
                parts.append(_Part(i, ctx, state, list(block), wanted, mode, confidence))
        if not parts:
            return out
        predicted = self.predict_blocks([p.state for p in parts], [p.ctx for p in parts], [p.block for p in parts])
        t1 = time.perf_counter()
        self.costs.predict.observe(t1 - t0)  # the whole batch's: it runs before any request drafts
        self.stats = ForesightStats(predict_s=t1 - t0, requests=len(parts))  # completed if drafting ends
        for p, (pred, logits, dec_states) in zip(parts, predicted):
            # A fixed temperature given at construction wins; else the request's own (from StartDraft).
            temperature = self.temperature if self.temperature is not None else p.ctx.temperature
            p.plan = self.plan(budget_s, p.mode)
            p.picked = self.select(logits, p.block, p.plan.outcomes, temperature, p.ctx.sampling, p.confidence)
            p.states = self.scorer.draft_states(pred, dec_states)
        parts = [p for p in parts if p.picked]
        if not parts or stop():
            return out
        refiners = self._predraft_many(parts, stop)
        t2 = time.perf_counter()
        self.stats = ForesightStats(sum(len(p.picked) for p in parts), t1 - t0, t2 - t1, t2 - t0, parts[0].plan,
                                    parts[0].mode, len(parts))
        for p, refiner in zip(parts, refiners):
            rows = zip(p.picked, refiner.drafts.tolist(), refiner.confidence, refiner.passes, refiner.refreshes)
            out[p.index] = [CacheEntry(accepted=o.k, bonus=o.a, tokens=tuple(d), score=o.score, passes=j, refreshes=r,
                                       confidence=tuple(c) if c is not None else ()) for o, d, c, j, r in rows]
        return out

    @torch.inference_mode()
    def _predraft_many(self, parts: list[_Part], stop: Callable[[], bool] | None = None) -> list[Refiner]:
        """Steps 4-5 for the picked outcomes of every part: J0 + (J - R) passes over all their rows in one
        draft-model batch, then per request R refreshes, each followed by a pass. A request's rows take the
        drafts of its own plan's pass (a pass does not depend on later ones) and its own width (the block is
        causal: a row padded to the widest block drafts its own positions as it would alone). Returns per
        part the refiner holding its drafts [B, max_drafts] and what each row spent."""
        contexts, inputs, fixed = [], [], []
        for p in parts:
            row_ctxs, prefixes = self.scorer.outcome_rows(p.ctx, p.state, p.states, p.block, p.picked)
            contexts += row_ctxs
            for o, prefix in zip(p.picked, prefixes):  # the request's own generator, in the order it draws alone
                noise = draw_noise(p.ctx.tokens + p.block[:o.k] + [o.a], p.max_drafts - 1, p.state.model.generator)
                inputs.append(torch.cat([torch.tensor(prefix), noise]))
                fixed.append(len(prefix))
        # Row b drafts at its positions fixed[b]-1 .. fixed[b]-2+max_drafts; shorter rows right-padded (causal).
        width = max(fixed) - 1 + max(p.max_drafts for p in parts)
        inputs = torch.stack([torch.cat([row, row.new_zeros(width - len(row))]) for row in inputs])  # [rows, width]
        fixed = torch.tensor(fixed)
        plain = [p.plan.passes - p.plan.refreshes for p in parts]
        t0 = time.perf_counter()
        ids, probs = self.model.draft_after_prefix(contexts, inputs, fixed, max(plain))
        self.costs.passes.observe(len(contexts), (time.perf_counter() - t0) / passes_run(ids))
        at = (fixed - 1)[:, None] + torch.arange(width - max(fixed) + 1)  # [rows, max_drafts]: each row's drafts
        refiners, start = [], 0
        for p, j in zip(parts, plain):
            rows = slice(start, start + len(p.picked))
            start = rows.stop
            drafts = ids[j].gather(1, at.to(ids[j].device))[rows, :p.max_drafts]
            confidence = probs[j].gather(1, at.to(probs[j].device))[rows, :p.max_drafts]
            refiners.append(Refiner(self.scorer.bound_rows(p.state, p.n), p.ctx.tokens[-1], p.block,
                                    [(o.k, o.a) for o in p.picked], drafts, p.mode, passes=j, confidence=confidence))
        for p, refiner in zip(parts, refiners):
            refiner.run(p.plan.refreshes, self.costs, stop)
        return refiners


def passes_run(outs: list[torch.Tensor]) -> int:
    """How many passes a Jacobi draft ran (J0 counts): the model repeats the last pass's tensor for the passes
    an early exit skipped (the block reached its fixed point), so the time divides by the passes that ran."""
    return 1 + sum(a is not b for a, b in zip(outs, outs[1:]))


@dataclass(slots=True)
class _Part:
    """One request's part of a foresight batch (`foresee_batch`), filled in stage by stage."""

    index: int  # the request's place in the batch
    ctx: DraftContext
    state: ForesightState
    block: list[int]  # d_1..d_gamma under verification
    max_drafts: int
    mode: str  # refinement
    confidence: Sequence[float] = ()  # the draft model's probability of each draft of the block
    plan: Plan | None = None
    picked: list[Outcome] = field(default_factory=list)
    states: torch.Tensor | None = None  # [gamma+1, n_src*H] the predicted draft-model states of the block

    @property
    def n(self) -> int:
        """The anchor's position (the true context's length)."""
        return len(self.ctx.tokens) - 1
