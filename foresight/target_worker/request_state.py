"""Per-request state held by the target worker."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..protocol.kinds import LOCAL_STRATEGIES, Mode, Strategy
from ..protocol.messages import DraftBlock, GenerateRequest, TokenLogprobs
from .grammar import GrammarState
from .logit_rules import LogitRules
from ..spec.sampling import PositionDraws
from ..control.round_planner import Hold
from ..control.strategy_choice import RequestChoice


@dataclass(slots=True)
class RequestState:
    request: GenerateRequest
    mode: Mode
    draws: PositionDraws  # the request's random draws, keyed by the position of the token they decide
    cache: object = None  # DynamicCache once the prefill started
    prefill_pos: int = 0  # prompt tokens in the cache: a long prompt is prefilled in chunks, one per step
    prefill_hidden: list[torch.Tensor] = field(default_factory=list)  # the chunks' target states, for StartDraft
    output_ids: list[int] = field(default_factory=list)
    round: int = 0  # the round whose block we wait for (0 = prefill pending)
    anchor: int | None = None  # newest committed token, not yet in the cache
    # The drafter holds this request's context and answers its outcomes. False in `ar` mode, and for a
    # request that started or went on while the drafter was down: it takes plain one-token steps.
    drafting: bool = False
    strategy: Strategy = Strategy.AR  # how the current round runs: the mode, or auto's choice
    choice: RequestChoice | None = None  # mode auto: this request's side of the strategy choice
    block: DraftBlock | None = None  # the drafter's block for `round` (its drafts cut to what the round may verify)
    # Tokens committed (and their target states [n, n_layers * hidden]) that the drafter has not been told of:
    # rounds it did not draft, which are reported in one Outcome when a round next asks it for a block, so
    # that a run of plain / prompt-lookup rounds never wakes the drafter.
    unsent: list[int] = field(default_factory=list)
    unsent_hidden: list[torch.Tensor] = field(default_factory=list)
    # The round of an Outcome that switched to a round the target runs alone, until the drafter answers it
    # with DrafterIdle (its foresight for the request may run until then: its cores are not free). 0: none.
    drafter_winding_down: int = 0
    # Mode auto switching to "pipelined": context positions the drafter's adapter and decoder have taken in or
    # take in with their next foresight job (a pipelined round's, a catch-up's); the rest they must catch up on.
    foreseen: int = 0
    hold: Hold = Hold.NONE  # why the current round does not run the request's own strategy (round_planner.py)
    last_verify_s: float = 0.0  # the drafter's foresight budget for the next round
    # The target's time this request's rounds consumed (mode auto's price of a round): the idle time of the
    # target while it waited for this request's block (shared with others waiting), then its own part of
    # the step that verified it (its drafts, and its share of the forward: step_cost.py).
    waited_s: float = 0.0  # since its last round ended
    round_cost_s: float = 0.0  # of the round just verified
    verify_share_s: float | None = None  # its part of that forward when it was batched (None: alone)
    outcome_sent_at: float = 0.0  # when we asked the drafter for `round`'s block
    block_received_at: float = 0.0
    arrived_at: float = field(default_factory=time.perf_counter)
    rules: LogitRules | None = None  # its logit bias, penalties and min_tokens (None: none)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # its prefill chunks', until sent
    grammar: GrammarState | None = None  # structured output: the grammar's state after the output (None: none)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def prefilled(self) -> bool:
        return self.prefill_pos >= len(self.request.prompt_ids)

    def take_prompt_logprobs(self) -> TokenLogprobs | None:
        """The prompt's logprobs, once (None: not wanted)."""
        if self.request.sampling.prompt_logprobs is None:
            return None
        joined, self.prompt_logprobs = TokenLogprobs.join(self.prompt_logprobs), []
        return joined

    def awaits_block(self) -> bool:
        """Does the current round verify a block from the drafter (not a plain step or local prompt lookup)?"""
        return self.drafting and self.strategy not in LOCAL_STRATEGIES

    def ready(self) -> bool:
        """Can the target do this request's next step without waiting for the drafter?"""
        return not self.prefilled or not self.awaits_block() or self.block is not None

    def detach(self) -> None:
        """Go on without the drafter (it is down): plain steps from now on (mode auto: the target's own prompt
        lookup, one of its choices), nothing awaited."""
        self.drafting = False
        self.strategy = Strategy.NGRAM if self.mode == Mode.AUTO else Strategy.AR
        self.choice = None
        self.block = None
        self.drafter_winding_down = 0
        self.hold = Hold.NONE

    @property
    def positions(self) -> int:
        """Committed tokens, prompt included (the anchor too)."""
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def cached_positions(self) -> int:
        """Positions in the cache after a round: every committed token but the anchor."""
        return self.positions - 1

    def tokens_left(self) -> int:
        return self.request.max_tokens - len(self.output_ids)

    def take_block(self) -> DraftBlock | None:
        block, self.block = self.block, None
        return block
