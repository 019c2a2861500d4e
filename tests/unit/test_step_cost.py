"""Under load a request is charged its part of a batched step; drafts then cost their marginal time, and
speculation shrinks toward plain steps as the batch grows."""
from __future__ import annotations

import pytest

from foresight.control.verify_length import best_length
from foresight.control.step_cost import StepCost

# A CPU-like cost law: reading the weights dominates, each fed position adds a little.
FIXED_S, PER_POSITION_S = 0.070, 0.004


def fitted(points: list[int]) -> StepCost:
    cost = StepCost()
    for _ in range(5):
        for p in points:
            cost.observe(p, FIXED_S + PER_POSITION_S * p)
    return cost


def test_the_fit_recovers_fixed_and_per_position_costs():
    fixed, per_position = fitted([8, 12, 20, 32, 40]).fit()
    assert fixed == pytest.approx(FIXED_S, rel=0.02)
    assert per_position == pytest.approx(PER_POSITION_S, rel=0.05)


def test_one_batch_shape_gives_no_slope_and_nothing_before_a_step():
    assert StepCost().fit() == (0.0, 0.0)
    fixed, per_position = fitted([8]).fit()
    assert per_position == 0.0 and fixed == pytest.approx(FIXED_S + 8 * PER_POSITION_S)


def test_shares_add_up_and_charge_drafts_their_marginal_cost():
    cost = fitted([8, 12, 20, 32, 40])
    lengths = [1] * 7 + [5]  # seven plain rows and one with four drafts
    t = FIXED_S + PER_POSITION_S * sum(lengths)
    shares = cost.shares(lengths, t)
    assert sum(shares) == pytest.approx(t)
    assert shares[-1] - shares[0] == pytest.approx(4 * PER_POSITION_S, rel=0.05)
    assert cost.shares([5], 0.1) == [0.1]  # alone, a request pays its whole step


def test_speculation_shrinks_as_the_batch_grows():
    """The same acceptance: drafts pay alone, not in a batch of 16 where each costs its position."""
    alphas = [0.45] * 7
    cost = fitted([16, 20, 32, 48, 64])

    def best(batch: int) -> int:
        costs = [cost.shares([1 + n] + [1] * (batch - 1), FIXED_S + PER_POSITION_S * (batch + n))[0]
                 for n in range(8)]  # this request's share when it sends n drafts
        return best_length(alphas, costs, min_length=0)

    assert best(1) >= 3
    assert best(16) < best(1)
    assert best(16) <= 1
