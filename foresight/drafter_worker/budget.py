"""The per-round work plan of foresight drafting (JetSpec++ Eq. 3): outcomes B, passes J, refreshes R.

While the target verifies a block the drafter runs one prediction (adapter + decoder over the block
under verification), the initial draft J0 and J Jacobi passes over B outcome rows, and a context
refresh of the rows before R of those passes. With measured per-row costs it must fit the budget (the
target's verify time):

    predict + B * ((1 + J) * pass + R * refresh)  <=  budget

B comes first: a missed outcome exposes a whole fallback draft, so as many outcomes as fit with J0
alone are drafted (at least one, at most the cap). The time left then buys passes one at a time, each
with a refresh before it while R is under its cap, a plain pass once the pair no longer fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["COST_EMA", "Plan", "StepCosts", "plan_round"]

COST_EMA = 0.3  # weight of the newest measurement in the running cost estimates
_EPS = 1e-9  # float slack, so that an exact fit counts as a fit


@dataclass(slots=True)
class StepCosts:
    """Running (EMA) estimates of the drafter's work, in seconds; 0 = not measured yet."""

    predict_s: float = 0.0  # adapter + decoder over one block row (the foresight prediction)
    pass_s: float = 0.0  # one batched draft pass, per outcome row
    refresh_s: float = 0.0  # one context refresh (adapter + decoder over the draft), per outcome row

    def update(self, name: str, seconds: float) -> None:
        old = getattr(self, name)
        setattr(self, name, seconds if not old else old + COST_EMA * (seconds - old))


@dataclass(frozen=True, slots=True)
class Plan:
    outcomes: int  # B: outcome rows drafted
    passes: int  # J: Jacobi passes after J0
    refreshes: int  # R <= J: passes preceded by a context refresh


def plan_round(costs: StepCosts, budget_s: float, max_outcomes: int, max_passes: int, max_refreshes: int) -> Plan:
    """B <= max_outcomes, J <= max_passes, R <= min(max_refreshes, J) that fit `budget_s` (see the module
    docstring). No budget (<= 0) or no measured pass cost yet: the caps. A refresh not measured yet is
    assumed to cost what the prediction of one row does."""
    if max_outcomes < 1 or max_passes < 0 or max_refreshes < 0:
        raise ValueError("need max_outcomes >= 1 and max_passes, max_refreshes >= 0")
    r_cap = min(max_refreshes, max_passes)
    if budget_s <= 0 or costs.pass_s <= 0:
        return Plan(max_outcomes, max_passes, r_cap)
    left = budget_s - costs.predict_s
    b = max(1, min(max_outcomes, math.floor(left / costs.pass_s + _EPS)))
    left -= b * costs.pass_s  # J0
    step = b * costs.pass_s  # one more pass over the B rows
    pair = step + b * (costs.refresh_s or costs.predict_s)  # a refresh and the pass after it
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
