"""Step 3 of a foresight round: the outcomes to pre-draft, from the scorer's logits for the block under verification.

Scored under the request's own verification (top-k, top-p, exact or nucleus), so that with a perfect scorer the
scores are the outcome law (JetSpec++ Proposition 1): Eq. 6 scores (or the calibrated scores of appendix B.1), the B
best by Eq. 7, and at temperature 0 the scorer's greedy path first. Two reductions keep it cheap without changing
what is picked: the scorer's logits are finite only on its vocabulary (`OutcomeScorer.vocab_columns`: the draft
model's subset), so the whole selection runs over those columns; and within them only each row's most probable
tokens, those tied with them and the drafts can be among the B best (`outcomes.candidate_columns`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..protocol.messages import SamplingParams
from ..spec.sampling import target_probs
from ..spec.verification import in_nucleus
from .calibration import Calibration, calibrated_scores
from .outcomes import Outcome, candidate_columns, outcome_scores, select_outcomes

TOP_PER_ROW = 32  # bonus candidates per accepted length that selection considers (B <= this)


def select_for_request(logits: torch.Tensor, block: list[int], B: int, temperature: float | None,
                       sampling: SamplingParams | None, calibration: Calibration | None = None,
                       confidence: Sequence[float] = (), greedy_first: bool = False,
                       columns: torch.Tensor | None = None) -> list[Outcome]:
    """The B outcomes of `block` to pre-draft, best first, from the scorer's logits [gamma+1, vocab] (float32).

    At temperature 0 the cache is ranked at temperature 1, where the nucleus gate of greedy verification is built
    too, with the greedy path first where `greedy_first`. `columns`: the sorted token ids outside which every logit
    is -inf (None: no such subset); the selection then runs over them alone, unless a draft lies outside them."""
    local = block_columns(columns, block)
    if local is not None:
        logits, block = logits[:, columns], local  # [gamma+1, V'] and the drafts as column indices
    t = 1.0 if not temperature else temperature
    top_k, top_p = (sampling.top_k, sampling.top_p) if sampling is not None else (0, 1.0)
    probs = target_probs(logits, t, top_k, top_p)  # [gamma+1, V]  p_hat as the target processes p
    sure = None
    if sampling is not None and sampling.verification == "nucleus" and block:
        sure = in_nucleus(probs[: len(block)], torch.tensor(block), sampling.nucleus_threshold)  # [gamma]
    greedy_top = None  # the scorer's greedy path: accept while d_i is row i-1's argmax
    if temperature is not None and temperature == 0 and greedy_first:
        greedy_top = logits.argmax(-1).tolist()
    picked = rank_outcomes(probs, block, B, calibration, confidence, sure, greedy_top)
    if local is None:
        return picked
    return [Outcome(o.k, int(columns[o.a]), o.score) for o in picked]


def block_columns(columns: torch.Tensor | None, block: list[int]) -> list[int] | None:
    """The drafts' indices among `columns` (sorted token ids), or None: no columns, or a draft not among them."""
    if columns is None:
        return None
    tokens = torch.tensor(block, dtype=torch.long)
    where = torch.searchsorted(columns, tokens).clamp(max=len(columns) - 1)  # [gamma]
    return where.tolist() if torch.equal(columns[where], tokens) else None


def rank_outcomes(probs: torch.Tensor, block: list[int], B: int, calibration: Calibration | None = None,
                  confidence: Sequence[float] = (), sure: torch.Tensor | None = None,
                  greedy_top: list[int] | None = None, whole_vocab: bool = False) -> list[Outcome]:
    """The B best outcomes of `block` from the target-processed probs [gamma+1, vocab], best first: Eq. 6 scores
    (calibrated with a `calibration`), Eq. 7 selection; with `greedy_top` (each row's argmax) the greedy path's
    outcome first. Scored over `candidate_columns` (whole_vocab: every column; the same outcomes)."""
    cols = None if whole_vocab else candidate_columns(probs, block, TOP_PER_ROW)
    local = block
    if cols is not None:  # [gamma+1, U] and the block in column indices
        probs, local = probs[:, cols], torch.searchsorted(cols, torch.tensor(block, dtype=torch.long)).tolist()
    if calibration is not None:
        scores = calibrated_scores(probs, local, calibration, confidence, sure)
    else:
        scores = outcome_scores(probs, local, sure)
    token = (lambda a: a) if cols is None else (lambda a: int(cols[a]))
    picked = [Outcome(o.k, token(o.a), o.score) for o in select_outcomes(scores, B, TOP_PER_ROW)]
    if greedy_top is None:
        return picked
    passed = [d == greedy_top[i] or (sure is not None and bool(sure[i])) for i, d in enumerate(block)]
    k = next((i for i, ok in enumerate(passed) if not ok), len(block))
    a = greedy_top[k] if cols is None else int(torch.searchsorted(cols, torch.tensor(greedy_top[k])))
    greedy = Outcome(k, greedy_top[k], float(scores.prefix[k] * scores.anchor[k, a]))
    return [greedy] + [o for o in picked if (o.k, o.a) != (greedy.k, greedy.a)][: B - 1]
