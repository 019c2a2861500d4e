"""Outcome scores and outcome selection of foresight drafting (JetSpec++ Eq. 6 and Eq. 7).

A block [anchor y0, d_1..d_gamma] ends verification at an outcome (k, a): the first k drafts are
accepted and token a is committed (the residual sample at position k+1 if k < gamma, else the bonus).
From the decoder's distributions p_hat(. | j), j = 0..gamma (row j = after d_1..d_j), Eq. 6 scores

    p_hat_i     = p_hat(d_i | i-1)                                   acceptance of d_i (row i-1)
    P(k)        = prod_{i<=k} p_hat_i                                all of d_1..d_k accepted
    P(k, a)     = P(k) * p_hat(a | k)     for a != d_{k+1},  k < gamma
    P(gamma, a) = P(gamma) * p_hat(a | gamma)

With a perfect decoder (p_hat = the target's distribution at the sampling temperature) P(k, a) is
exactly the law of the verification outcome for any draft fixed before verification (Proposition 1,
appendix F.1): rejecting d_{k+1} has probability 1 - p_{k+1}(d_{k+1}) and the residual divides by the
same amount. The scores of all outcomes sum to 1 (the sum over a at length k is P(k) - P(k+1)).

The same holds for the request's actual verification, with p_hat the target's distribution processed
as the request samples (temperature, top-k, top-p; `select_for_request`): under nucleus verification
a draft inside the target's nucleus is always accepted, so for such a d_i the acceptance factor is 1
and no outcome ends at length i-1 (`sure`); drafts outside it follow the exact rule.

Eq. 7 caches the B outcomes with the highest scores; outcomes are disjoint events, so the hit
probability of a cache S is sum_{(k,a) in S} P(k, a).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["OutcomeScores", "Outcome", "outcome_scores", "select_outcomes", "top_tokens", "hit_probability",
           "candidate_columns"]


@dataclass(frozen=True, slots=True)
class OutcomeScores:
    """P(k, a) = prefix[k] * anchor[k, a], kept factorised ((gamma+1) * vocab products are rarely needed)."""

    prefix: torch.Tensor  # [gamma+1]         P(k) = prod_{i<=k} p_hat_i,  prefix[0] = 1
    anchor: torch.Tensor  # [gamma+1, vocab]  p_hat(a | k), with a = d_{k+1} set to 0 for k < gamma

    @property
    def gamma(self) -> int:
        return self.prefix.shape[0] - 1

    def dense(self) -> torch.Tensor:
        """All scores P(k, a): [gamma+1, vocab] (zero at the impossible outcomes (k, d_{k+1}))."""
        return self.prefix[:, None] * self.anchor


class Outcome(NamedTuple):
    k: int  # accepted drafts
    a: int  # committed token
    score: float  # P(k, a)


def outcome_scores(dec_probs: torch.Tensor, draft, sure: torch.Tensor | None = None) -> OutcomeScores:
    """Eq. 6 from the decoder's rows.

    dec_probs  [gamma+1, vocab]  p_hat(. | j), row j = after d_1..d_j (rows sum to 1)
    draft      [gamma]           d_1..d_gamma (list or LongTensor; gamma may be 0)
    sure       [gamma] bool      drafts verification accepts whenever it reaches them (the nucleus gate);
                                 None: none (exact verification)
    """
    probs = dec_probs.float()  # [gamma+1, vocab]
    draft = torch.as_tensor(draft, dtype=torch.long, device=probs.device).reshape(-1)  # [gamma]
    gamma = draft.shape[0]
    if probs.dim() != 2 or probs.shape[0] != gamma + 1:
        raise ValueError(f"dec_probs must be [gamma+1, vocab] = [{gamma + 1}, V], got {tuple(probs.shape)}")
    accept = probs[:gamma].gather(-1, draft[:, None]).squeeze(-1)  # [gamma]  p_hat_i = p_hat(d_i | i-1)
    if sure is not None:
        accept = torch.where(sure.to(probs.device), torch.ones_like(accept), accept)
    prefix = torch.cat([accept.new_ones(1), torch.cumprod(accept, dim=0)])  # [gamma+1]  P(0..gamma)
    rows = torch.arange(gamma, device=probs.device)
    anchor = probs.clone()
    anchor[rows, draft] = 0.0  # a = d_{k+1} is acceptance, not an outcome at length k
    if sure is not None:
        anchor[:gamma][sure.to(probs.device)] = 0.0  # d_{k+1} is never rejected: no outcome at length k
    return OutcomeScores(prefix=prefix, anchor=anchor)


def select_outcomes(scores: OutcomeScores, B: int, top_per_row: int | None = 32) -> list[Outcome]:
    """The B highest-scoring outcomes (Eq. 7), best first; ties by smaller k, then smaller token id.

    Only the `top_per_row` most probable tokens of each row are candidates (None: all), which is
    exact for B <= top_per_row: an outcome outside its row's top tokens has that many better ones
    in the same row. Ties at a row's cut-off keep the smaller token ids. Outcomes with score 0
    (impossible) are never returned, so fewer than B can come back.
    """
    if B <= 0:
        return []
    anchor = scores.anchor  # [gamma+1, vocab]
    n_rows, vocab = anchor.shape
    n_top = vocab if top_per_row is None else min(vocab, top_per_row)
    keep = top_tokens(anchor, n_top)  # bool [gamma+1, vocab], exactly n_top per row
    k, a = keep.nonzero(as_tuple=True)  # [n_rows * n_top]  ordered by (k, a)
    cand = scores.prefix[k] * anchor[k, a]  # [n_rows * n_top]  P(k, a)
    # A stable descending sort keeps the (k, a) order among equal scores.
    order = torch.sort(cand, descending=True, stable=True).indices[:B]
    picked = torch.stack([k[order].double(), a[order].double(), cand[order].double()], dim=-1).tolist()
    return [Outcome(int(kk), int(aa), s) for kk, aa, s in picked if s > 0.0]


def candidate_columns(probs: torch.Tensor, draft, n_top: int) -> torch.Tensor | None:
    """The token ids any of the scores of the best outcomes reads, ascending: in each row every token at least as
    probable as its (n_top+1)-th (its n_top best bonus candidates once its draft token is set aside, and every token
    tied with them), and the drafts. probs [gamma+1, vocab] -> [U]. Scoring and selecting over these columns alone
    (`select_outcomes` with top_per_row <= n_top, `calibrated_scores`) picks what the whole vocabulary picks, ties by
    smaller id included (the columns keep the ids' order). None: n_top + 1 > vocab (score every column).
    Why: dense scores cost in proportion to the vocabulary, and they run inside the verify-time budget
    (docs/journal/2026-12-07-pipeline-round-log.md)."""
    if n_top + 1 > probs.shape[-1]:
        return None
    last = torch.topk(probs, n_top + 1, dim=-1).values[:, -1:]  # [gamma+1, 1] each row's (n_top+1)-th largest
    keep = ((probs >= last) & (probs > 0)).any(0)  # [vocab] zero-probability tokens are never an outcome
    draft = torch.as_tensor(draft, dtype=torch.long, device=probs.device).reshape(-1)
    return torch.unique(torch.cat([keep.nonzero().reshape(-1), draft]))  # sorted ascending


def top_tokens(rows: torch.Tensor, n_top: int) -> torch.Tensor:
    """The n_top largest entries of each row, ties at the cut-off broken by smaller index.  bool [R, V]

    torch.topk picks among equal values arbitrarily; here every token strictly above the row's
    n_top-th value is kept, and the tied ones fill the remaining slots in index order.
    """
    cut = torch.topk(rows, n_top, dim=-1).values[:, -1:]  # [R, 1]  n_top-th largest value
    above = rows > cut  # [R, V]
    tied = rows == cut  # [R, V]
    room = n_top - above.sum(-1, keepdim=True)  # [R, 1]  slots left for the tied tokens
    return above | (tied & (tied.cumsum(-1) <= room))


def hit_probability(selected) -> float:
    """sum_{(k,a) in S} P(k, a): the chance that verification ends at a cached outcome."""
    return float(sum(outcome[2] for outcome in selected))  # Outcome or plain (k, a, score)
