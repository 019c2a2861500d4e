"""The pieces of a target step that are not the worker's loop: what a step runs, what a round verifies,
how a block is judged, and the small facts the drafter and the evaluations share (seeds, stop tokens)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from ..protocol.messages import DraftBlock, RoundStats
from .logit_rules import LogitRules
from .request_state import RequestState
from ..spec.sampling import PositionDraws
from ..spec.verification import Verdict, verify


@dataclass(slots=True)
class StepPlan:
    """One step of the target: the rounds it verifies (one forward when batching) and a prompt chunk."""

    rounds: list[RequestState]
    prefill: RequestState | None = None

    @classmethod
    def of(cls, state: RequestState) -> "StepPlan":
        """A step of one request alone."""
        return cls(rounds=[state]) if state.prefilled else cls(rounds=[], prefill=state)

    def members(self) -> list[RequestState]:
        return self.rounds + ([self.prefill] if self.prefill is not None else [])


@dataclass(slots=True)
class Round:
    """One request's round, from its drafts to the `RoundStats` of its verification."""

    state: RequestState
    draft: list[int]
    block: DraftBlock | None  # the drafter's block the drafts come from (None: the target's own, none or lookup)
    exposed: float | None  # seconds the target waited for that block

    @property
    def with_drafts(self) -> bool:
        """Does the round verify a block from the drafter?"""
        return self.block is not None

    def stats(self, verdict: Verdict, verify_s: float, compiled: bool | None) -> RoundStats:
        """What the api hears of the round (`compiled`: whether a graph ran its forward; None: no graphs)."""
        block = self.block
        return RoundStats(drafted=len(self.draft), accepted=verdict.accepted, nucleus_extra=verdict.nucleus_extra,
                          verify_s=verify_s, exposed_draft_s=self.exposed,
                          cache_hit=block.cache_hit if block else None, passes=block.passes if block else 0,
                          refreshes=block.refreshes if block else 0, strategy=self.state.strategy, compiled=compiled)


def verify_block(logits: torch.Tensor, draft: list[int], sampling, draws: PositionDraws, position: int) -> Verdict:
    """Apply the request's verification rule to one block (logits [len(draft) + 1, vocab]) whose rows decide
    the tokens at positions position.. (the draws are the request's for those positions)."""
    block = None if sampling.temperature == 0 else draws.block(position, len(draft) + 1, logits.shape[-1],
                                                               logits.device)
    return verify(logits, draft, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                  rule=sampling.verification, theta=sampling.nucleus_threshold, draws=block)


def decided_by_argmax(state: RequestState) -> bool:
    """Whether a round of `state` reads only the argmax of each row of its logits: greedy, exact verification (the
    nucleus gate reads the distribution), no logit rules, grammar or logprobs."""
    sampling = state.request.sampling
    return (sampling.temperature == 0 and sampling.verification == "exact" and sampling.logprobs is None
            and state.rules is None and state.grammar is None)


def ruled(state: RequestState, result, draft: list[int], head) -> torch.Tensor:
    """The request's logit rules (logit_rules.py) and grammar (grammar.py) applied to its round's logits
    `result.logits` [len(draft) + 1, vocab] (`decided_with`)."""
    if state.rules is None and state.grammar is None:
        return result.logits
    apply = None if state.rules is None else partial(state.rules.apply, output_ids=state.output_ids, draft=draft)
    if state.grammar is not None:
        allowed = state.grammar.masks(draft)  # [len(draft) + 1, vocab]
        if apply is None:
            return grammar_only(result, allowed, head)
        apply = masked(apply, allowed)
    return decided_with(apply, result, head)


def grammar_only(result, allowed: torch.Tensor, head) -> torch.Tensor:
    """The logits with -inf outside the grammar (`allowed` [rows, vocab]). Where every row's maximum is allowed, the
    entries near it are the ones the runner refined already (a mask only lowers the others), so the fp32 refinement
    runs again only for rows whose maximum the grammar forbids."""
    out = result.logits.float().masked_fill(~allowed, float("-inf"))
    if head is None or result.head_input is None or allowed.gather(-1, result.logits.argmax(-1, keepdim=True)).all():
        return out
    return decided_with(masked(None, allowed), result, head)


def masked(rules, allowed: torch.Tensor):
    """`rules` (None: none) followed by -inf at the tokens `allowed` [rows, vocab] (bool) rules out. Where the two
    leave a row no token (min_tokens holding back the stop tokens that are all a complete grammar still allows), the
    grammar wins: that row keeps the unruled logits of what the grammar allows, so the request may end there."""
    def apply(logits: torch.Tensor) -> torch.Tensor:
        out = (logits.float() if rules is None else rules(logits)).masked_fill(~allowed, float("-inf"))
        empty = ~out.isfinite().any(-1)  # [rows]
        if rules is not None and empty.any():
            out[empty] = logits[empty].float().masked_fill(~allowed[empty], float("-inf"))
        return out
    return apply


def ruled_logits(rules: LogitRules, output_ids: list[int], result, draft: list[int], head) -> torch.Tensor:
    """`rules` applied to a forward's logits `result.logits` [len(draft) + 1, vocab] after `output_ids`."""
    return decided_with(partial(rules.apply, output_ids=output_ids, draft=draft), result, head)


def decided_with(apply, result, head) -> torch.Tensor:
    """`apply` (row-wise rules) on a forward's logits; with a low-precision target's fp32 head (`head`,
    runner.head), refined again near the ruled maxima (`Fp32LogitHead.refine_ruled`)."""
    if head is None or result.head_input is None:
        return apply(result.logits)
    return head.refine_ruled(result.logits, result.head_input, apply)


def take_verdict(state: RequestState, verdict: Verdict) -> None:
    """What the request's own state follows of a verdict: its grammar takes the accepted drafts and the token."""
    if state.grammar is not None:
        state.grammar.commit(verdict.accepted, verdict.token)


def last_row(result):
    """A forward's result as if it had kept its last position's logits only (what `prefill` keeps)."""
    head_input = result.head_input[-1:] if result.head_input is not None else None
    return replace(result, logits=result.logits[-1:], head_input=head_input)


def drafter_seed(seed: int) -> int:
    """A seed for the drafter's noise that differs from the target's draws (drafts must not correlate with them)."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**63


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
