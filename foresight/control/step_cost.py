"""What one request's part of a batched target step costs: the price speculation pays under load.

A target forward costs a fixed part (reading the weights, about the same for 1 or 30 positions on a CPU)
plus a part per fed position. Alone, a request pays the whole step, so drafts are nearly free; in a
batch of B requests the fixed part is shared while every draft still costs its position -- the reason
speculation stops paying as load grows (what vLLM users handle by hand with `disable_by_batch_size`).

`StepCost` fits  t = fixed + per_position * P  (P = positions the step fed, all rows) by exponentially
weighted least squares over recent steps, and charges row b of a step that took t seconds
    share_b = t * (fixed / B + per_position * n_b) / (fixed + per_position * P),
so the shares add up to t, a lone request is charged t, and a draft is charged its marginal cost. The
auto strategy choice and the prompt-lookup verify length measure rounds by these shares: as the batch
grows, drafts cost relatively more, and speculation shrinks toward plain steps by itself.
"""
from __future__ import annotations

from .rates import LineFit

DECAY = 0.98  # weight of the past per observed step: about the last 50 steps count
PRIOR_WEIGHT = 1.0  # pseudo-steps pulling the fit toward "positions cost nothing" until data say otherwise


class StepCost:
    def __init__(self, decay: float = DECAY):
        self.line = LineFit(decay)  # seconds against positions fed

    def observe(self, positions: int, seconds: float) -> None:
        self.line.add(positions, seconds)

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per position), both >= 0; (0, 0) before any step."""
        fixed, per_position = self.line.fit(ridge=PRIOR_WEIGHT)
        return max(0.0, fixed), per_position

    def shares(self, lengths: list[int], seconds: float) -> list[float]:
        """Each row's part of a step that fed `lengths[b]` positions per row and took `seconds`."""
        if len(lengths) == 1:
            return [seconds]
        fixed, per_position = self.fit()
        weights = [fixed / len(lengths) + per_position * n for n in lengths]
        total = sum(weights)
        if total <= 0.0:
            return [seconds * n / sum(lengths) for n in lengths]
        return [seconds * w / total for w in weights]
