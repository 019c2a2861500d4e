"""Running estimates of measured seconds, one estimator for every cost the drafter plans with: the
target's verify time (the foresight budget, and by block length for the verify-length controller), the
foresight prediction, and batched draft passes and refreshes by rows (`budget.StepCosts`).

Each estimate is an exponential moving average with the same weight for the newest measurement: the
machine's speed drifts (other processes, thermal state, cache contents), so old measurements fade.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .rates import LineFit, ema

PRIOR_WEIGHT = 2.0  # pseudo-measurements behind the line when shrinking a size's own estimate towards it


@dataclass(slots=True)
class RunningCost:
    """Seconds of one piece of work whose size does not vary (0.0 until measured)."""

    seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.seconds = ema(self.seconds if self.count else None, seconds)
        self.count += 1


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b * L over {L: seconds}, each length weighing one (`LineFit`)."""
    line = LineFit()
    for length, seconds in points.items():
        line.add(length, seconds)
    return line.fit()


@dataclass(slots=True)
class CostBySize:
    """Seconds of one piece of work by its size: the target's verify by block length (drafts sent), the
    drafter's batched pass or refresh by rows in the batch (`budget.StepCosts`)."""

    seconds: dict[int, float] = field(default_factory=dict)  # size -> running estimate of seconds
    counts: dict[int, int] = field(default_factory=dict)  # size -> measurements

    def observe(self, length: int, seconds: float) -> None:
        self.seconds[length] = ema(self.seconds.get(length), seconds)
        self.counts[length] = self.counts.get(length, 0) + 1

    def measured(self, min_length: int = 0) -> int:
        """How many distinct lengths >= min_length have a measurement."""
        return sum(1 for length in self.seconds if length >= min_length)

    def costs(self, n: int) -> list[float]:
        """Estimated seconds for L = 0..n. A measured length: its EMA, shrunk towards the line by its count
        (one noisy measurement does not rule a length out for good). Unseen: the line, never below the
        cheapest measurement (extrapolating a steep line down to short blocks could go to zero)."""
        if not self.seconds:
            return [1.0] * (n + 1)
        # The line is fitted over L >= 1 only: L = 0 is a one-position forward, which on CPU runs another
        # kernel regime (GEMV, not GEMM) and would bend the line; it keeps its own measurement.
        blocks = {length: s for length, s in self.seconds.items() if length > 0} or self.seconds
        a, b = fit_line(blocks)
        floor = min(blocks.values())
        out = []
        for length in range(n + 1):
            line = max(a + b * length, floor)
            if length in self.seconds:
                c = self.counts[length]
                line = (c * self.seconds[length] + PRIOR_WEIGHT * line) / (c + PRIOR_WEIGHT)
            out.append(line)
        return out
