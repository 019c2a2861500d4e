"""Target distribution processing (temperature, top-k, top-p) and seeded sampling."""
import math

import pytest
import torch
from scipy import stats

from foresight.protocol.messages import SamplingParams
from foresight.spec.sampling import _top_p_removed, is_greedy, process_logits, sample, target_probs


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def logits_of(p):
    return torch.tensor(p, dtype=torch.float64).log().float()


def kept(probs):
    return set(torch.nonzero(probs > 0).flatten().tolist())


def reference_probs(logits, temperature, top_k, top_p):
    """Plain full-sort implementation of the same processing, for comparison."""
    z = logits.double() / temperature
    out = []
    for row in z.reshape(-1, z.shape[-1]):
        if top_k and 0 < top_k < row.numel():
            row = row.masked_fill(row < torch.sort(row, descending=True).values[top_k - 1], -math.inf)
        p = torch.softmax(row, -1)
        if top_p < 1.0:
            order = sorted(range(p.numel()), key=lambda j: (-p[j].item(), j))  # p desc, id asc
            mass, keep = 0.0, torch.zeros(p.numel(), dtype=torch.bool)
            for j in order:
                if mass >= top_p:
                    break
                keep[j] = True
                mass += p[j].item()
            p = torch.where(keep, p, 0.0)
            p = p / p.sum()
        out.append(p)
    return torch.stack(out).reshape(logits.shape)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    got = target_probs(logits, temperature)
    torch.testing.assert_close(got, torch.softmax(logits / temperature, -1))
    assert got.dtype == torch.float32


def test_low_precision_logits_processed_in_float32():
    logits = (torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    got = target_probs(logits, 0.7, top_k=20, top_p=0.9)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(3))
    torch.testing.assert_close(got, reference_probs(logits.float(), 0.7, 20, 0.9).float())


def test_top_k_keeps_k_largest_and_ties_at_the_kth():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    p = target_probs(logits, 1.0, top_k=2)
    assert kept(p) == {1, 3}
    torch.testing.assert_close(p[[1, 3]], torch.softmax(logits[[1, 3]], -1))
    tied = target_probs(torch.tensor([3.0, 2.0, 2.0, 1.0]), 1.0, top_k=2)  # as vLLM / HF: ties stay
    assert kept(tied) == {0, 1, 2}


@pytest.mark.parametrize("off", [0, -1, None, 5, 9])
def test_top_k_off(off):
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    torch.testing.assert_close(target_probs(logits, 1.0, top_k=off), torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p, expected", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, expected):
    p = target_probs(logits_of([0.5, 0.3, 0.15, 0.05]), 1.0, top_p=top_p)
    assert kept(p) == expected
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    idx = sorted(expected)
    torch.testing.assert_close(p[idx], base[idx] / base[idx].sum())


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([0.1, 0.2, 0.15, 0.05])  # nearly flat: the top token has ~26%
    assert kept(target_probs(logits, 1.0, top_p=1e-6)) == {1}


def test_top_p_ties_break_by_lower_token_id():
    # 0.4 + 0.3 reaches 0.6: the smallest set has two tokens; among the tied 0.3s the lower id wins.
    assert kept(target_probs(logits_of([0.4, 0.3, 0.3]), 1.0, top_p=0.6)) == {0, 1}
    assert kept(target_probs(logits_of([0.3, 0.3, 0.4]), 1.0, top_p=0.6)) == {0, 2}


def test_top_p_ties_in_a_large_flat_vocab_keep_the_lowest_ids():
    p = target_probs(torch.zeros(2, 300), 1.0, top_p=0.501)  # uniform: 151 tokens reach 0.501
    assert kept(p[0]) == kept(p[1]) == set(range(151))


def test_top_p_boundary_is_inclusive():
    # Exact binary fractions: {0, 1} has mass exactly 0.75 >= top_p, so token 2 is removed.
    removed = _top_p_removed(torch.tensor([0.5, 0.25, 0.125, 0.125]), 0.75)
    assert removed.tolist() == [False, False, True, True]


def test_top_k_applies_before_top_p():
    # top-k=2 renormalises [0.45, 0.35] to [0.5625, 0.4375]; top-p=0.55 then keeps only token 0.
    # top-p on the unfiltered p (0.45 < 0.55) would keep tokens 0 and 1.
    p = target_probs(logits_of([0.45, 0.35, 0.2]), 1.0, top_k=2, top_p=0.55)
    assert kept(p) == {0}


def test_temperature_applies_before_top_p():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert kept(target_probs(logits, 1.0, top_p=0.65)) == {0, 1}
    assert kept(target_probs(logits, 0.25, top_p=0.65)) == {0}  # sharper: 0.4^4 / sum > 0.65


def test_top_p_on_a_large_vocab_matches_a_full_sort():
    # vocab 5000 and rows of different flatness exercise every candidate size (256, 4096, all).
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 5000, generator=gen) * torch.tensor([[0.1], [1.0], [3.0], [8.0]])
    for top_p in (0.3, 0.9, 0.999):
        got = target_probs(logits, 1.0, top_p=top_p)
        ref = reference_probs(logits, 1.0, 0, top_p).float()
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref)
    got = process_logits(logits, 0.8, top_k=300, top_p=0.95)
    ref = reference_probs(logits, 0.8, 300, 0.95)
    assert torch.equal(torch.isfinite(got), ref > 0)


def test_greedy_is_the_point_mass_at_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 0.0, 4.9]])
    p = target_probs(logits, 0.0, top_k=3, top_p=0.5)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert is_greedy(0.0) and is_greedy(SamplingParams(temperature=0.0))
    assert not is_greedy(0.7) and not is_greedy(SamplingParams())


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_parameters_raise(kwargs):
    args = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError):
        target_probs(torch.zeros(2, 4), **args)


def test_sample_is_reproducible_under_a_seed():
    probs = torch.softmax(torch.randn(64, 30, generator=torch.Generator().manual_seed(3)), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    c = sample(probs, torch.Generator().manual_seed(8))
    assert a.shape == (64,) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_law_and_zero_mass():
    # Unnormalised weights with zero-probability tokens at both ends.
    weights = torch.tensor([0.0, 2.0, 1.0, 0.5, 0.0, 3.0, 0.25, 0.0])
    p = weights / weights.sum()
    n = 40_000
    draws = sample(weights.expand(n, -1), torch.Generator().manual_seed(4))
    counts = torch.bincount(draws, minlength=8).double()
    assert counts[p == 0].sum() == 0
    nz = p > 0
    stat = (((counts[nz] - n * p[nz]) ** 2) / (n * p[nz])).sum().item()
    limit = stats.chi2.ppf(1 - 1e-4, int(nz.sum()) - 1)  # false-alarm rate 1e-4
    assert stat < limit
    # The same test rejects a slightly wrong law (so it has power at this n).
    q = p.roll(1) * 0.05 + p * 0.95
    bad = (((counts[nz] - n * q[nz]) ** 2) / (n * q[nz])).sum().item()
    assert bad > limit


def test_sample_extreme_uniforms_stay_on_positive_mass(monkeypatch):
    """u = 0 and u = 1 - 2^-53 (the extremes of torch.rand) must still land on tokens with p > 0."""
    weights = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0]])
    real_rand = torch.rand
    for u, want in ((0.0, 2), (1.0 - 2.0**-53, 5)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full_like(real_rand(*a, **k), u))
        assert sample(weights).tolist() == [want]


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_vanishing_top_p_keeps_the_top_token(top_p):
    # 5e-324 is a valid top_p in (0, 1] but 0.0 in float32: the top token must still be kept.
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    probs = target_probs(logits, 1.0, 0, top_p)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.allclose(probs.max(-1).values, torch.ones(2))


def test_position_draws_depend_on_seed_and_position_only():
    """However positions are grouped into blocks, each gets the same draws: a seeded request's text cannot
    depend on its draft lengths."""
    from foresight.spec.sampling import PositionDraws

    draws = PositionDraws(7)
    whole = draws.block(10, 6, 50)
    assert whole.exponentials.shape == (6, 50) and whole.uniforms.shape == (6,)
    for k in range(6):
        part = draws.block(10 + k, 1, 50)
        assert torch.equal(part.exponentials[0], whole.exponentials[k]) and part.uniforms[0] == whole.uniforms[k]
    assert not torch.equal(PositionDraws(8).block(10, 6, 50).exponentials, whole.exponentials)
    assert (whole.exponentials > 0).all() and ((whole.uniforms >= 0) & (whole.uniforms < 1)).all()


def test_the_exponential_race_samples_the_distribution():
    """argmax p(x) / E_x over position-keyed Exp(1) draws has law p (each count within 5 standard errors),
    and never draws a zero-probability token."""
    from foresight.spec.sampling import PositionDraws

    n, p = 20000, torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    tokens = sample(p.expand(n, -1), exponentials=PositionDraws(3).exponentials(0, n, len(p)))
    counts = torch.bincount(tokens, minlength=len(p)).double()
    sd = (n * p * (1 - p)).double().sqrt()
    assert ((counts - n * p).abs() <= 5 * sd).all(), counts
    assert counts[-1] == 0
