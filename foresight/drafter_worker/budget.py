"""The per-round work plan of foresight drafting (JetSpec++ Eq. 3): outcomes B, passes J, refreshes R.

While the target verifies a block the drafter runs one prediction (adapter + decoder over the block
under verification), the initial draft J0 and J Jacobi passes over B outcome rows in one batch, and a
context refresh of the rows before R of those passes. With measured costs it must fit the budget (the
target's verify time):

    predict + (1 + J) * pass(B) + R * refresh(B)  <=  budget

pass(B) and refresh(B) are the seconds of one batched pass / refresh over B rows, measured by batch size
(`costs.CostBySize`: a running estimate per size, a least-squares line for sizes not measured). They are not B times a
per-row cost: where a few-row pass costs what reading the weights costs (CPU, GPU decode) four rows cost
about what one does, and a per-row model would wrongly trade outcomes for passes.

B comes first: a missed outcome exposes a whole fallback draft, so the most outcomes whose J0 fits are
drafted (at least one, at most the cap). The time left then buys passes one at a time, each with a
refresh before it while R is under its cap, a plain pass once the pair no longer fits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..control.costs import CostBySize, RunningCost

__all__ = ["Plan", "StepCosts", "plan_round"]

_EPS = 1e-9  # float slack, so that an exact fit counts as a fit


@dataclass(slots=True)
class StepCosts:
    """Running estimates of the drafter's work, in seconds; nothing measured = 0 / empty."""

    predict: RunningCost = field(default_factory=RunningCost)  # adapter + decoder over the block under verification
    passes: CostBySize = field(default_factory=CostBySize)  # one batched draft pass, by rows
    refreshes: CostBySize = field(default_factory=CostBySize)  # one batched context refresh, by rows

    @property
    def predict_s(self) -> float:
        return self.predict.seconds

    def pass_s(self, rows: int) -> float:
        """One pass over `rows` rows (0: not measured yet)."""
        return self.passes.costs(rows)[rows] if self.passes.seconds else 0.0

    def refresh_s(self, rows: int) -> float:
        """One refresh of `rows` rows; before any was measured, one prediction's cost (a refresh is one
        prediction over the rows: assuming it cheap lets the first one run and be measured)."""
        return self.refreshes.costs(rows)[rows] if self.refreshes.seconds else self.predict_s


@dataclass(frozen=True, slots=True)
class Plan:
    outcomes: int  # B: outcome rows drafted
    passes: int  # J: Jacobi passes after J0
    refreshes: int  # R <= J: passes preceded by a context refresh


def plan_round(costs: StepCosts, budget_s: float, max_outcomes: int, max_passes: int, max_refreshes: int) -> Plan:
    """B <= max_outcomes, J <= max_passes, R <= min(max_refreshes, J) that fit `budget_s` (see the module
    docstring). No budget (<= 0) or no measured pass yet: the caps."""
    if max_outcomes < 1 or max_passes < 0 or max_refreshes < 0:
        raise ValueError("need max_outcomes >= 1 and max_passes, max_refreshes >= 0")
    r_cap = min(max_refreshes, max_passes)
    if budget_s <= 0 or not costs.passes.seconds:
        return Plan(max_outcomes, max_passes, r_cap)
    left = budget_s - costs.predict_s
    b = max([1] + [n for n in range(1, max_outcomes + 1) if costs.pass_s(n) <= left + _EPS])
    step = costs.pass_s(b)  # one more pass over the B rows
    left -= step  # J0
    pair = step + costs.refresh_s(b)  # a refresh and the pass after it
    j = r = 0
    while j < max_passes:
        if r < r_cap and pair <= left + _EPS:
            left, r = left - pair, r + 1
        elif step <= left + _EPS:
            left -= step
        else:
            break
        j += 1
    return Plan(b, j, r)
