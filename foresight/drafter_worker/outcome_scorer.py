"""What a foresight drafter plugs in to score a block's outcomes and to draft each picked one (JetSpec++ 4.2).

`ForesightDrafter` (foresight.py) runs the round: plan B, J and R, pick the outcomes from the scores, draft them in
one batch, refine. The scorer decides the rest:
    `AdapterDecoderScorer` (decoder_scorer.py)  the adapter predicts the target's states of the block and the target's
                                                top layers score it (the paper's foresight);
    `DraftModelScorer` (draft_model_scorer.py)  decoder depth 0: the draft model scores its own block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..models.decoder import DecoderCache
from ..models.draft_model import ContextKV
from ..protocol.messages import HiddenLayout, LinearStates
from .jetspec_proposer import DraftModelState
from .outcomes import Outcome
from .proposer import DraftContext

# (adapter prediction [gamma+1, n_adapter*H] or None, logits [gamma+1, vocab] float32, decoder states or None)
Prediction = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]


@dataclass(slots=True)
class ForesightState:
    """One request's foresight state (in `DraftContext.states`); the adapter and decoder fields are the
    `AdapterDecoderScorer`'s (None and empty for a scorer without them)."""

    model: DraftModelState  # the draft model's context and the request's noise generator (the JetSpec proposer's)
    adapter: object = None  # the adapter's context
    decoder: DecoderCache | None = None
    scored: int = 0  # context positions the adapter and decoder have absorbed
    unscored: list = field(default_factory=list)  # [n, ...] target states the draft model took, the adapter not yet
    decoder_new: list = field(default_factory=list)  # [n, H] states at the decoder's input its cache lacks
    linear_states: LinearStates | None = None  # hybrid targets: the newest committed state of the decoder's layers

    @property
    def draft(self) -> ContextKV | None:
        return self.model.ctx


class OutcomeScorer(Protocol):
    layout: HiddenLayout | None  # the target states the round reads (None: the draft model's own sources only)
    decoder_layers: int  # target layers that score the outcomes (0: the draft model scores them)
    refines: bool  # refinement can run: it refreshes drafts with predicted states
    greedy_first: bool  # at temperature 0 the scores' greedy path is pre-drafted first (`ForesightDrafter.select`)
    # The sorted token ids the scores' logits can be finite at (the draft model's vocabulary; None: every token):
    # selection runs over them alone (outcome_selection.py)
    vocab_columns: torch.Tensor | None

    def new_state(self, model: DraftModelState) -> ForesightState:
        """A request's state over the draft model's `model`."""
        ...

    def take_states(self, state: ForesightState, states: torch.Tensor | None, draft_only: bool) -> None:
        """The committed target states [n, layout.width] the draft model just absorbed (None: none); unless
        `draft_only`, the scorer's own models take them in now."""
        ...

    def lags(self, ctx: DraftContext, state: ForesightState | None) -> bool:
        """Does the scorer lack more of the context than one foresight round should take in (a new prompt)?"""
        ...

    def catch_up(self, state: ForesightState, stop: Callable[[], bool]) -> bool:
        """Take in every committed state not absorbed yet, pausing between passes when `stop()`; True when done."""
        ...

    def predict_blocks(self, states: list[ForesightState], ctxs: list[DraftContext],
                       blocks: list[list[int]]) -> list[Prediction]:
        """Steps 1-2 for each request's block [y0, d_1..d_gamma] under verification, all in one pass."""
        ...

    def draft_states(self, pred: torch.Tensor | None, dec_states: torch.Tensor | None) -> torch.Tensor | None:
        """The block's predicted states in the draft model's source order [gamma+1, n_src*H] (None: none)."""
        ...

    def outcome_rows(self, ctx: DraftContext, state: ForesightState, states: torch.Tensor | None, block: list[int],
                     outcomes: list[Outcome]) -> tuple[list[ContextKV], list[list[int]]]:
        """Step 4's rows: per outcome its draft context and the block's fixed inputs (the anchor a first, or
        y0, d_1..d_k, a)."""
        ...

    def bound_rows(self, state: ForesightState, n: int):
        """What `Refiner` refreshes drafts with over the request's context of n positions (None: `refines` is off)."""
        ...


def block_rows(ctxs: list[DraftContext], blocks: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Each request's [anchor, d_1..d_gamma] as rows [G, L], a shorter block right-padded with its anchor (the
    rows are causal: padding changes no real position), and each row's real length."""
    lengths = [len(block) + 1 for block in blocks]
    width = max(lengths)
    tokens = torch.tensor([[ctx.tokens[-1], *block] + ctx.tokens[-1:] * (width - length)
                           for ctx, block, length in zip(ctxs, blocks, lengths)])
    return tokens, lengths


def sorted_columns(subset: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """`vocab_columns` of a scorer whose logits are -inf outside `subset` (token ids; None or every token: None)."""
    if subset is None or len(subset) == vocab_size:
        return None
    return torch.sort(subset.long().cpu()).values
