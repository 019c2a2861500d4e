"""Foresight at decoder depth 0: the draft model scores the outcomes itself (JetSpec++ section 4.2 without
the adapter and decoder).

On a small target the adapter and a deep decoder cost about as much as the verification foresight should
hide under. At depth 0 the round keeps only the draft model, which already holds the request's true
context (positions 0..n-1):

    scores    one draft-model pass over the block under verification [y0, d_1..d_gamma] at positions
              n..n+gamma; row j is q(. | d_1..d_j), the draft model's distribution of the token after d_j,
              taken for the target's p_hat(. | j) in Eq. 6 (its vocabulary subset; the rest scores 0)
    drafting  outcome (k, a): ONE block over the same true context whose first k+2 inputs are the real
              tokens y0, d_1..d_k, a (kept by every Jacobi pass) and whose next ones are J0 noise; the
              positions after a give the outcome's draft. The draft model is trained on such clean
              prefixes (training/dataset.py); what it lacks, against depth >= 1, are the target's states
              of positions n..n+k, which the adapter would predict.

No refinement (a refresh needs the adapter and decoder); a calibration only when one fit at depth 0 is
given (`--calibration PATH`: the shipped one was fit on the decoder's scores).
"""
from __future__ import annotations

import torch

from ..models.draft_model import ContextKV, DraftModel
from .jetspec_proposer import DraftModelState
from .outcome_scorer import ForesightState, Prediction, block_rows, sorted_columns
from .outcomes import Outcome
from .proposer import DraftContext

__all__ = ["DraftModelScorer"]


class DraftModelScorer:
    """The draft model's own probabilities as the outcome scores: see the module."""

    layout = None  # the target sends the draft model's sources only
    decoder_layers = 0
    refines = False
    # At temperature 0 the draft model's greedy path over its own block accepts every draft: a point mass on
    # an outcome its overconfidence makes up. Its temperature-1 scores rank better (docs/journal/2026-12-03-decoder-depth-0.md).
    greedy_first = False

    def __init__(self, model: DraftModel):
        self.model = model
        self.vocab_columns = sorted_columns(model.vocab_subset, model.config.vocab_size)

    def new_state(self, model: DraftModelState) -> ForesightState:
        return ForesightState(model=model)

    def take_states(self, state: ForesightState, states: torch.Tensor | None, draft_only: bool) -> None:
        pass  # the draft model's context is all there is

    def lags(self, ctx: DraftContext, state: ForesightState | None) -> bool:
        return False  # the draft model takes its states in one pass when it drafts

    def catch_up(self, state: ForesightState, stop) -> bool:
        return True

    @torch.inference_mode()
    def predict_blocks(self, states: list[ForesightState], ctxs: list[DraftContext],
                       blocks: list[list[int]]) -> list[Prediction]:
        """One draft-model pass over every request's [y0, d_1..d_gamma] -> per request (None, logits
        [gamma+1, vocab] float32 with -inf outside the draft model's vocabulary, None)."""
        for state, ctx in zip(states, ctxs):
            if state.model.positions != len(ctx.tokens) - 1:
                raise ValueError(f"foresight needs the true states of positions 0..{len(ctx.tokens) - 2}, "
                                 f"have {state.model.positions}")
        tokens, lengths = block_rows(ctxs, blocks)  # [G, L]
        sub = self.model.block_logits([state.draft for state in states], tokens)  # [G, L, V']
        subset = self.model.vocab_subset.to(sub.device)
        out = []
        for g, length in enumerate(lengths):
            logits = sub.new_full((length, self.model.config.vocab_size), float("-inf"))  # [gamma+1, vocab]
            logits[:, subset] = sub[g, :length]
            out.append((None, logits, None))
        return out

    def draft_states(self, pred, dec_states) -> None:
        return None  # no predicted states: `outcome_rows` puts the block's tokens into each row instead

    def outcome_rows(self, ctx: DraftContext, state: ForesightState, states, block: list[int],
                     outcomes: list[Outcome]) -> tuple[list[ContextKV], list[list[int]]]:
        """Per outcome (k, a): the true context, and the fixed inputs y0, d_1..d_k, a (the block starts at
        the anchor's position n whatever k)."""
        return [state.draft] * len(outcomes), [[ctx.tokens[-1], *block[:o.k], o.a] for o in outcomes]

    def bound_rows(self, state: ForesightState, n: int) -> None:
        return None  # refinement never runs here (`refines`): plans carry no refresh

