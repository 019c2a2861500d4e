"""How many of the drafted tokens to send for verification (the verify length).

The target's verify cost grows with the block length while deep drafts are rarely accepted. So each round
the drafter sends the prefix of its block that maximises committed tokens per second:

    L* = argmax_L (1 + E[accepted | L]) / (fixed_s + cost(L)),   E[accepted | L] = sum_{j<=L} prod_{i<=j} alpha_i

    cost(L)   the target's verify seconds for a block of L drafts (Outcome.verify_s), by length
              (`costs.CostBySize`: a running estimate per length, a line for unseen lengths)
    alpha_i   P(draft i accepted | drafts 1..i-1 accepted): the proposer's confidence in draft i through
              an online calibration, or (no confidences, e.g. n-gram) a per-position rate learned online
    fixed_s   the part of the round that does not depend on L: the exposed drafting time of this block

Any prefix of a block is a valid block: verification stays lossless whatever L is chosen.

L = 0 (no drafts: a plain decoding step) competes too once its cost has been measured (one probe round):
where a 2-position forward costs much more than a 1-position one (a CPU), a weak drafter does not pay even
for a single draft. When the last SKIP_AFTER choices are 0 the drafter stops drafting (`draft_length` = 0) until an
exploring round, which drafts and verifies a full block and records the length it would choose now,
says speculation pays again; so the acceptance model keeps learning (`allow_skip=False`: L >= 1).

One controller per drafter worker: verify costs are the target's and acceptance statistics are pooled
over requests (sampled and greedy requests alike).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .costs import CostBySize

ACCEPT_DECAY = 0.99  # per observed round: acceptance statistics forget over ~100 rounds
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each acceptance prior
CONF_BINS = 10  # calibration bins over the confidence range [0, 1]
SKIP_AFTER = 3  # consecutive choices of L = 0 after which the drafter stops drafting
DRAFT_MARGIN = 2  # drafts drafted beyond the longest recently chosen length (room for confident blocks)


def expected_accepted(alphas: Sequence[float]) -> list[float]:
    """E[accepted | L] for L = 0..len(alphas); alphas[i] = P(draft i+1 accepted | drafts 1..i accepted)."""
    out, survive = [0.0], 1.0
    for a in alphas:
        survive *= a
        out.append(out[-1] + survive)
    return out


def best_length(alphas: Sequence[float], costs: Sequence[float], fixed_s: float = 0.0, min_length: int = 1) -> int:
    """argmax over L in min_length..len(alphas) of expected tokens per second; costs[L] for L = 0..len(alphas).
    The longest L wins a tie (equal rate, more tokens)."""
    expected = expected_accepted(alphas)
    best, best_rate = len(alphas), float("-inf")
    for length in range(len(alphas), min(min_length, len(alphas)) - 1, -1):
        rate = (1.0 + expected[length]) / max(fixed_s + costs[length], 1e-9)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


def _posterior(accepted: float, tried: float, prior: float) -> float:
    return (accepted + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)


def _bin(confidence: float) -> int:
    return min(CONF_BINS - 1, max(0, int(confidence * CONF_BINS)))


@dataclass(slots=True)
class Acceptance:
    """Per-draft acceptance probabilities: confidence -> probability (binned calibration), and per-position
    conditional rates for proposers without confidences. Counts decay so the model tracks the workload."""

    pos_accepted: list[float] = field(default_factory=list)  # [positions] position i: draft i+1
    pos_tried: list[float] = field(default_factory=list)
    bin_accepted: list[float] = field(default_factory=lambda: [0.0] * CONF_BINS)  # [CONF_BINS]
    bin_tried: list[float] = field(default_factory=lambda: [0.0] * CONF_BINS)

    def observe(self, sent: int, accepted: int, confidence: Sequence[float] = ()) -> None:
        """Drafts 1..accepted were accepted, draft accepted+1 (if sent) rejected; later drafts were never
        tried (their acceptance was conditional on one that failed), so they are not counted."""
        for counts in (self.pos_accepted, self.pos_tried, self.bin_accepted, self.bin_tried):
            counts[:] = [c * ACCEPT_DECAY for c in counts]
        tried = min(sent, accepted + 1)
        grow = tried - len(self.pos_tried)
        if grow > 0:
            self.pos_accepted += [0.0] * grow
            self.pos_tried += [0.0] * grow
        with_conf = len(confidence) == sent
        for i in range(tried):
            ok = float(i < accepted)
            self.pos_accepted[i] += ok
            self.pos_tried[i] += 1.0
            if with_conf:
                b = _bin(confidence[i])
                self.bin_accepted[b] += ok
                self.bin_tried[b] += 1.0

    def alphas(self, n: int, confidence: Sequence[float] = ()) -> list[float]:
        """alpha_i for drafts 1..n: calibrated confidences when given (len n), else per-position rates
        shrunk towards the pooled rate (deep positions are rarely tried)."""
        if len(confidence) == n:
            return [_posterior(self.bin_accepted[_bin(c)], self.bin_tried[_bin(c)], (_bin(c) + 0.5) / CONF_BINS)
                    for c in confidence]
        pooled = _posterior(sum(self.pos_accepted), sum(self.pos_tried), 0.5)
        out = []
        for i in range(n):
            seen = i < len(self.pos_tried)
            out.append(_posterior(self.pos_accepted[i] if seen else 0.0, self.pos_tried[i] if seen else 0.0, pooled))
        return out


class VerifyLengthController:
    """Observes each verified block, chooses the length of the next one (see the module docstring)."""

    def __init__(self, min_rounds: int = 8, explore_every: int = 16, min_length: int = 1, allow_skip: bool = True,
                 cost: CostBySize | None = None):
        """`min_rounds`: verified blocks to see before truncating; `explore_every`: every such round (by the
        request's round number) sends the full block, so long blocks keep being measured; `allow_skip`: L = 0
        (no drafts: a plain decoding step) may win once its cost is measured (see `choose`); `cost`: verify
        costs shared with other controllers (they are the target's, whoever drafted)."""
        self.cost = cost if cost is not None else CostBySize()
        self.acceptance = Acceptance()
        self.min_rounds = min_rounds
        self.explore_every = explore_every
        self.min_length = min_length
        self.allow_skip = allow_skip
        self.rounds = 0  # verified blocks observed
        self.recent: deque[int] = deque(maxlen=explore_every)  # lengths chosen lately (non-exploring rounds)

    def observe(self, sent: int, accepted: int, verify_s: float, confidence: Sequence[float] = ()) -> None:
        """The block of `sent` drafts (confidences `confidence`, or none) had `accepted` accepted and took
        `verify_s` seconds to verify. verify_s <= 0: nothing was verified (the round after the prefill)."""
        if verify_s <= 0:
            return
        self.cost.observe(sent, verify_s)
        if sent > 0:
            self.acceptance.observe(sent, accepted, confidence)
            self.rounds += 1

    def choose(self, n: int, confidence: Sequence[float], round_: int, fixed_s: float = 0.0) -> int:
        """How many of `n` drafts to send in request round `round_`; `fixed_s`: exposed drafting time."""
        if n <= self.min_length or self.rounds < self.min_rounds:
            return n
        if round_ % self.explore_every == 0:
            self.recent.append(self.best(n, confidence, fixed_s))  # what this round would choose: lets a
            return n                                               # skipped speculation come back
        if self.allow_skip and 0 not in self.cost.seconds and round_ % self.explore_every == self.explore_every // 4:
            return 0  # probe a plain step once, so that skipping speculation can be weighed
        if self.cost.measured(self.min_length) < 2:
            # One block length measured: the cost line is flat and would always pick n. Probe the
            # shortest length now and then so the slope becomes known.
            return self.min_length if round_ % self.explore_every == self.explore_every // 2 else n
        length = self.best(n, confidence, fixed_s)
        self.recent.append(length)
        return length

    def best(self, n: int, confidence: Sequence[float], fixed_s: float) -> int:
        """The length with the most expected tokens per second; 0 (skip) only once a plain step was measured."""
        floor = 0 if self.allow_skip and 0 in self.cost.seconds else self.min_length
        return best_length(self.acceptance.alphas(n, confidence), self.cost.costs(n), fixed_s, floor)

    def draft_length(self, max_drafts: int, round_: int) -> int:
        """How many drafts to draft for request round `round_`: drafting costs time in proportion to the
        block length, so once the chosen lengths are known, draft DRAFT_MARGIN more than the longest of
        them; all of `max_drafts` while warming up, on exploring rounds and before any choice was made."""
        if self.rounds < self.min_rounds or round_ % self.explore_every == 0 or not self.recent:
            return max_drafts
        if len(self.recent) >= SKIP_AFTER and not any(list(self.recent)[-SKIP_AFTER:]):
            return 0  # speculation has not paid lately: plain steps until an exploring round says otherwise
        return min(max_drafts, max(self.recent) + DRAFT_MARGIN)
