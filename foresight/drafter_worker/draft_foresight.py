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
given (`--calibration PATH`: the shipped one was fit on the decoder's scores). The rest of the round (plan,
select, batched drafting, the speculation cache) is `ForesightDrafter`'s.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import EngineConfig
from ..models.draft_model import ContextKV, DraftModel
from ..protocol.kinds import Refinement
from .calibration import Calibration
from .foresight import STATE_KEY, ForesightDrafter, _RequestState, block_rows, load_calibration
from .jetspec_proposer import JetSpecProposer
from .outcomes import Outcome
from .proposer import DraftContext

__all__ = ["DraftOnlyForesight", "draft_only_from_config"]


class DraftOnlyForesight(ForesightDrafter):
    """A JetSpec draft model with foresight from its own probabilities: supports pipelined mode without an
    adapter."""

    refines = False
    # At temperature 0 the draft model's greedy path over its own block accepts every draft: a point mass on
    # an outcome its overconfidence makes up. Its temperature-1 scores rank better (docs/journal/2026-12-03-decoder-depth-0.md).
    greedy_first = False

    def __init__(self, model: DraftModel, passes: int | None = None, cache_size: int = 4,
                 foresight_passes: int | None = None, temperature: float | None = None, use_budget: bool = True,
                 calibration: Calibration | None = None):
        """As `ForesightDrafter`, without adapter, decoder and refinement; `calibration`: one fit at depth 0
        (`foresight calibrate-foresight --decoder-layers 0`)."""
        self._init_round(model, passes, cache_size, foresight_passes, temperature, 0, Refinement.NONE,
                         use_budget, calibration)
        self.adapter = self.decoder = None
        self.jetspec = JetSpecProposer(model, self.passes)  # the target sends the draft model's sources only
        self.layout = self.jetspec.layout

    @property
    def decoder_layers(self) -> int:
        return 0

    def state(self, ctx: DraftContext) -> _RequestState:
        state = ctx.states.get(STATE_KEY)
        if state is None:
            state = ctx.states[STATE_KEY] = _RequestState(model=self.jetspec.state(ctx))
        return state

    def _absorb(self, ctx: DraftContext, draft_only: bool = False) -> _RequestState:
        """The committed target states not absorbed yet into the draft model's context (all there is)."""
        state = self.state(ctx)
        self.jetspec.absorb(ctx)
        return state

    absorb = _absorb

    def lags(self, ctx: DraftContext) -> bool:
        return False  # the draft model takes its states in one pass when it drafts

    def catch_up(self, ctx: DraftContext, stop) -> bool:
        """`ForesightDrafter.catch_up`: here the draft model is all there is, one pass."""
        self._absorb(ctx)
        return True

    @torch.inference_mode()
    def _predict_blocks(self, states: list[_RequestState], ctxs: list[DraftContext], blocks: list[list[int]]):
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

    def outcome_rows(self, ctx: DraftContext, state: _RequestState, states, block: list[int],
                     outcomes: list[Outcome]) -> tuple[list[ContextKV], list[list[int]]]:
        """Per outcome (k, a): the true context, and the fixed inputs y0, d_1..d_k, a (the block starts at
        the anchor's position n whatever k)."""
        return [state.draft] * len(outcomes), [[ctx.tokens[-1], *block[:o.k], o.a] for o in outcomes]

    def bound_rows(self, state: _RequestState, n: int) -> None:
        return None  # refinement never runs here (`refines`): plans carry no refresh


def draft_only_from_config(drafter_path: Path, cfg: EngineConfig) -> DraftOnlyForesight:
    """The draft model from its checkpoint, with foresight at decoder depth 0. A calibration only from a
    PATH: the one shipped beside the adapter (`auto`) was fit on the decoder's scores."""
    proposer = JetSpecProposer.from_config(drafter_path, cfg)
    calibration = None if cfg.calibration in ("auto", "none") else load_calibration(cfg, drafter_path)
    return DraftOnlyForesight(proposer.model, passes=cfg.draft_passes, cache_size=cfg.cache_size,
                              use_budget=cfg.foresight_budget, calibration=calibration)
