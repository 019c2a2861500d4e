"""Verification rules: exact (point-mass and general q) and NSD's nucleus gate.

Statistical tests run N blocks in one `verify_batch` call on small synthetic distributions
(vocab 8) with fixed seeds. Laws are compared with a chi-square test at false-alarm rate 1e-4;
rates with |measured - expected| <= 5 * sqrt(var / N) (5 standard errors). Each statistical test
also checks that the same samples reject a wrong law, so it has power at its N.
"""
import pytest
import torch
from scipy import stats

from foresight.spec.sampling import target_probs
from foresight.spec.verification import (
    Verdict,
    excess_mass,
    in_nucleus,
    nucleus_mask,
    verify,
    verify_batch,
)

V = 8
N = 40_000


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_logits(seed, rows, scale=1.5):
    return torch.randn(rows, V, generator=gen(seed)) * scale


def chi2_stat(counts, law):
    """Chi-square of observed counts against a law; cells with expectation < 5 are pooled."""
    counts, law = counts.double().flatten(), law.double().flatten()
    n = counts.sum()
    assert counts[law == 0].sum() == 0, "outcome outside the support of the law"
    expected = n * law
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (law > 0)].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big & (law > 0)].sum().reshape(1)])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    return stat, stats.chi2.ppf(1 - 1e-4, int(keep.sum()) - 1)


def assert_law(counts, law, wrong_law=None):
    stat, limit = chi2_stat(counts, law)
    assert stat < limit, f"chi2 {stat:.1f} >= {limit:.1f}"
    if wrong_law is not None:  # power: the same counts reject a wrong law
        counts = counts.double().flatten()
        exp = counts.sum() * wrong_law.double().flatten()
        outside = (counts[exp == 0] > 0).any()
        bad = (((counts - exp) ** 2)[exp > 0] / exp[exp > 0]).sum().item()
        assert outside or bad > limit


def run(p, drafts, seed, **kw):
    """N blocks with the same target laws p [gamma+1, V]; drafts [N, gamma]."""
    return verify_batch(p.expand(drafts.shape[0], -1, -1), drafts, generator=gen(seed), **kw)


def emitted_first(drafts, accepted, token):
    """The first committed token of each block: d_1 if accepted, else the residual / bonus."""
    if drafts.shape[1] == 0:
        return token
    return torch.where(accepted >= 1, drafts[:, 0], token)


def rate_close(measured, expected, n):
    sd = (expected * (1 - expected) / n) ** 0.5
    assert abs(measured - expected) <= 5 * sd + 1e-9, (measured, expected, sd)


# ------------------------------------------------------------------ exact, point-mass drafts

SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS)
def test_exact_outcome_law_is_proposition_1(params):
    """P(k, a) = prod_{i<=k} p_i(d_i) * p_{k+1}(a) (a != d_{k+1}); P(gamma, a) = prod p_i(d_i) p_{gamma+1}(a)."""
    gamma = 3
    logits = random_logits(10, gamma + 1)
    p = target_probs(logits, **params)  # [gamma+1, V]
    draft = p[:gamma].argmax(-1)  # fixed draft, accepted often enough to reach every k
    drafts = draft.expand(N, -1)
    accepted, token, extra = run(p, drafts, seed=11)
    assert extra.sum() == 0

    def law(p):
        out = torch.zeros(gamma + 1, V, dtype=torch.float64)
        prefix = 1.0
        for k in range(gamma + 1):
            row = p[k].double().clone()
            if k < gamma:
                row[draft[k]] = 0.0  # a rejection never commits d_{k+1}
            out[k] = prefix * row
            if k < gamma:
                prefix *= p[k, draft[k]].item()
        return out

    analytic = law(p)
    torch.testing.assert_close(analytic.sum(), torch.tensor(1.0, dtype=torch.float64))
    counts = torch.zeros(gamma + 1, V).index_put_((accepted, token), torch.ones(N), accumulate=True)
    p_hot = target_probs(logits, **(params | dict(temperature=params["temperature"] * 1.2)))
    assert_law(counts, analytic, wrong_law=law(p_hot))


@pytest.mark.parametrize("gamma", [0, 2])
def test_exact_first_committed_token_follows_p1(gamma):
    logits = random_logits(20, gamma + 1)
    p = target_probs(logits, 1.0, top_k=6, top_p=0.8)
    drafts = torch.full((N, gamma), int(p[0].argsort()[-2]))  # the second most likely token
    accepted, token, _ = run(p, drafts, seed=21)
    first = emitted_first(drafts, accepted, token)
    assert_law(torch.bincount(first, minlength=V), p[0], wrong_law=target_probs(logits[0], 1.0))


def test_exact_never_uses_draft_softmax():
    """A point-mass draft is accepted with prob p(d), whatever its drafter believed (JetSpec++ F.3)."""
    p = torch.tensor([[0.6, 0.3, 0.1, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0]])
    accepted, _, _ = run(p, torch.zeros(N, 1, dtype=torch.long), seed=31)
    rate_close(accepted.double().mean().item(), 0.6, N)  # with q(d) = 0.9, min(1, p/q) would give 2/3


def test_verify_equals_verify_batch_and_is_reproducible():
    gamma = 4
    logits = random_logits(40, gamma + 1, scale=1.0)
    draft = [1, 2, 3, 4]
    q = torch.softmax(random_logits(41, gamma), -1)

    def verdicts(seed, **kw):
        g = gen(seed)
        return [verify(logits, draft, generator=g, **kw) for _ in range(200)]

    for kw in (dict(), dict(rule="nucleus", theta=0.5), dict(draft_probs=q, rule="nucleus", theta=0.5)):
        a = verdicts(5, **kw)
        assert a == verdicts(5, **kw) and a != verdicts(6, **kw)  # same seed, same verdicts
        g, p = gen(5), target_probs(logits, 1.0)
        kw_batch = kw | dict(draft_probs=q[None] if "draft_probs" in kw else None)
        batch = [verify_batch(p[None], torch.tensor([draft]), generator=g, **kw_batch) for _ in range(200)]
        assert a == [Verdict(*(int(t) for t in v)) for v in batch]


def test_greedy_exact_verify_decides_as_verify_batch_on_point_masses():
    """`verify` at T=0 (exact) reads the argmax off the logits; `verify_batch` decides from the point masses
    `target_probs` builds: the same verdicts, ties (first index wins) and empty drafts included."""
    for seed in range(30):
        g = gen(300 + seed)
        gamma = seed % 6
        logits = torch.randint(0, 4, (gamma + 1, 12), generator=g).float()  # many equal maxima
        top = logits.argmax(-1)
        draft = torch.where(torch.rand(gamma, generator=g) < 0.7, top[:gamma], torch.randint(0, 12, (gamma,), generator=g))
        p = target_probs(logits, 0.0, 3, 0.9)
        want = Verdict(*(int(t) for t in verify_batch(p[None], draft[None], greedy=True)))
        assert verify(logits, draft.tolist(), temperature=0.0, top_k=3, top_p=0.9) == want


@pytest.mark.parametrize("rule", ["exact", "nucleus"])
def test_greedy_accepts_longest_prefix_matching_argmax(rule):
    gamma = 5
    logits = torch.randn(gamma + 1, 50, generator=gen(50))
    top = logits.argmax(-1).tolist()
    q = torch.softmax(torch.randn(gamma, 50, generator=gen(51)), -1)
    for m in range(gamma + 1):
        draft = top[:gamma]
        if m < gamma:
            draft = draft[:m] + [(top[m] + 1) % 50] + draft[m + 1:]
        for draft_probs in (None, q):
            # theta 1e-6: the nucleus holds only the top token (see test_greedy_nucleus_*).
            v = verify(logits, draft, temperature=0.0, rule=rule, theta=1e-6, draft_probs=draft_probs)
            assert v == Verdict(accepted=m, token=top[m], nucleus_extra=0)


def test_greedy_nucleus_with_only_the_top_token_equals_exact():
    """theta <= p_top at every position: N_theta holds the argmax alone, so nucleus == exact."""
    gamma, vocab = 6, 12
    logits = torch.randn(gamma + 1, vocab, generator=gen(60)) * 0.3  # flat at temperature 1
    theta = float(torch.softmax(logits, -1).max(-1).values.min()) * 0.999
    g = gen(61)
    for _ in range(50):
        draft = torch.randint(0, vocab, (gamma,), generator=g)
        draft[:3] = logits[:3].argmax(-1)  # reach later positions too
        exact = verify(logits, draft, temperature=0.0, rule="exact")
        nsd = verify(logits, draft, temperature=0.0, rule="nucleus", theta=theta)
        assert nsd == exact and nsd.nucleus_extra == 0


def test_greedy_nucleus_gates_on_the_temperature_one_distribution():
    """Greedy NSD accepts a non-argmax draft iff it lies in N_theta(softmax(logits)); it commits the
    argmax on rejection; every such acceptance counts as extra."""
    gamma, vocab = 6, 12
    logits = torch.randn(gamma + 1, vocab, generator=gen(62)) * 0.3
    p1 = torch.softmax(logits, -1)  # [gamma+1, vocab]
    top = logits.argmax(-1)
    g = gen(63)
    extra_seen = 0
    for _ in range(100):
        draft = torch.randint(0, vocab, (gamma,), generator=g)
        v = verify(logits, draft, temperature=0.0, rule="nucleus", theta=0.6)
        ok = [bool(draft[i] == top[i]) or bool(in_nucleus(p1[i], draft[i], 0.6)) for i in range(gamma)]
        k = next((i for i, x in enumerate(ok) if not x), gamma)
        assert v.accepted == k
        assert v.token == int(top[k])
        assert v.nucleus_extra == sum(int(draft[i] != top[i]) for i in range(k))
        extra_seen += v.nucleus_extra
    assert extra_seen > 0


# ------------------------------------------------------------------ nucleus set and excess mass


def brute_mask(p, theta):
    above = torch.stack([p[p > x].sum() for x in p])
    return (above < theta) & (p > 0)


def test_nucleus_mask_ties_and_zero_mass():
    p = torch.tensor([[0.4, 0.3, 0.3, 0.0]])
    assert nucleus_mask(p, 0.5).tolist() == [[True, True, True, False]]  # ties both in
    assert nucleus_mask(p, 0.4).tolist() == [[True, False, False, False]]  # 0.4 above is not < 0.4
    assert nucleus_mask(p, 1.0).tolist() == [[True, True, True, False]]  # zero mass never in
    assert nucleus_mask(p, 1e-9).tolist() == [[True, False, False, False]]  # top token always in
    short = torch.tensor([[0.5, 0.25, 0.25 - 2.0**-20, 0.0]])  # mass a rounding error below 1
    assert nucleus_mask(short, 1.0).tolist() == [[True, True, True, False]]
    assert in_nucleus(short.expand(4, -1), torch.arange(4), 1.0).tolist() == [True, True, True, False]
    with pytest.raises(ValueError):
        nucleus_mask(p, 0.0)
    # The boundary below theta = 1, in numbers float32 holds exactly: a token with exactly theta above it is out.
    halves = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    assert nucleus_mask(halves, 0.5).tolist() == [[True, False, False, False]]
    assert in_nucleus(halves.expand(4, -1), torch.arange(4), 0.5).tolist() == [True, False, False, False]
    assert in_nucleus(halves.expand(4, -1), torch.arange(4), 0.75).tolist() == [True, True, True, False]


def test_nucleus_mask_and_in_nucleus_match_brute_force():
    g = gen(70)
    for _ in range(30):
        p = torch.randint(0, 6, (V,), generator=g).float()  # many ties, some zeros
        p = p / p.sum()
        for theta in (0.05, 0.3, 0.6, 0.9, 1.0):
            want = brute_mask(p, theta)
            assert torch.equal(nucleus_mask(p[None], theta)[0], want)
            assert torch.equal(in_nucleus(p.expand(V, -1), torch.arange(V), theta), want)


def test_excess_mass_formula():
    g = gen(80)
    for _ in range(20):
        p = torch.softmax(torch.randn(V, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
        theta = 0.8
        es = excess_mass(p, q, theta).item()
        want = sum(max(q[x] - p[x], 0.0) for x in range(V) if brute_mask(p, theta)[x])
        assert es == pytest.approx(float(want), abs=1e-6)
        assert es <= 0.5 * (p - q).abs().sum().item() + 1e-6  # ES <= R
    assert excess_mass(p, p, 0.9).item() == 0.0


# ------------------------------------------------------------------ NSD (section 3, appendix A.2)

THETA = 0.8


def nsd_pair(seed):
    """A (p, q) pair whose draft puts excess mass on a nucleus token that is not the top token."""
    g = gen(seed)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    second = p.argsort()[-2]
    q = 0.5 * torch.softmax(torch.randn(V, generator=g), -1)
    q[second] += 0.5
    return p, q


def nsd_emitted_law(p, q, theta):
    """A.2: p'(x) = min(p, q) + [x in N] max(q - p, 0) + (R - ES) max(p - q, 0) / R."""
    p, q = p.double(), q.double()
    mask = nucleus_mask(p, theta)
    r = torch.clamp(p - q, min=0)
    R, ES = r.sum(), (torch.clamp(q - p, min=0) * mask).sum()
    return torch.minimum(p, q) + mask * torch.clamp(q - p, min=0) + (R - ES) * r / R, ES.item(), R.item()


@pytest.mark.parametrize("seed", [90, 91, 92])
def test_nsd_extra_acceptance_and_error_equal_excess_mass(seed):
    p, q = nsd_pair(seed)
    law, es, R = nsd_emitted_law(p, q, THETA)
    assert 0.05 < es < R
    # The analytic law is a distribution whose TV distance from p is exactly ES.
    assert law.sum().item() == pytest.approx(1.0, abs=1e-6)  # float32 p and q
    assert 0.5 * (law - p.double()).abs().sum().item() == pytest.approx(es, abs=1e-6)

    drafts = torch.multinomial(q, N, replacement=True, generator=gen(seed + 100))[:, None]  # d ~ q
    p2 = torch.stack([p, torch.full((V,), 1.0 / V)])  # [gamma+1 = 2, V]
    accepted, token, extra = run(p2, drafts, seed=seed + 200, rule="nucleus", theta=THETA, draft_probs=q[None])
    rate_close(extra.double().mean().item(), es, N)  # extra acceptance = ES
    rate_close(accepted.double().mean().item(), 1 - R + es, N)  # acceptance 1 - R -> 1 - R + ES
    counts = torch.bincount(emitted_first(drafts, accepted, token), minlength=V)
    assert_law(counts, law, wrong_law=p)  # the emitted law is p', which is detectably not p
    # Empirical TV from p = ES within the noise floor 0.5 * sum_x 5 * sd_x, sd_x = sqrt(p'_x (1 - p'_x) / N).
    tv = 0.5 * (counts.double() / N - p.double()).abs().sum().item()
    assert abs(tv - es) <= 0.5 * 5 * (law * (1 - law) / N).sqrt().sum().item()


def test_nsd_point_mass_drafts():
    """ES = [d in N](1 - p(d)): a nucleus draft is always kept; an outside draft uses the exact rule."""
    p = target_probs(random_logits(100, 1), 1.0)[0]
    order = p.argsort(descending=True)
    inside, outside = order[1], order[-1]
    theta = p[order[0]].item() + 1e-3  # N = top two tokens
    p2 = torch.stack([p, p])
    for d, es in ((inside, 1 - p[inside].item()), (outside, 0.0)):
        assert excess_mass(p, torch.nn.functional.one_hot(d, V).float(), theta).item() == pytest.approx(es)
        drafts = torch.full((N, 1), int(d))
        accepted, token, extra = run(p2, drafts, seed=101, rule="nucleus", theta=theta)
        rate_close(extra.double().mean().item(), es, N)
        first = emitted_first(drafts, accepted, token)
        if es > 0:
            assert torch.all(first == d)  # emitted law delta(d): TV from p = 1 - p(d) = ES
        else:
            assert extra.sum() == 0
            assert_law(torch.bincount(first, minlength=V), p, wrong_law=torch.full((V,), 1.0 / V))


def test_nsd_larger_theta_never_lowers_acceptance_or_error():
    """Nested nuclei on the same draws: the accepted length and ES can only grow with theta."""
    gamma, n = 3, 5_000
    g = gen(110)
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma, V, generator=g) * 2.0, -1)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(gamma)], 1)
    prev_k, prev_es = None, None
    for theta in (0.05, 0.3, 0.5, 0.7, 0.9, 1.0):
        k, _, extra = run(p, drafts, seed=111, rule="nucleus", theta=theta, draft_probs=q)
        es = excess_mass(p[:gamma], q, theta)  # [gamma]
        if prev_k is not None:
            assert torch.all(k >= prev_k) and torch.all(es >= prev_es)
        prev_k, prev_es = k, es
    exact_k, _, exact_extra = run(p, drafts, seed=111, rule="exact", draft_probs=q)
    assert exact_extra.sum() == 0 and prev_k.sum() > exact_k.sum()  # theta = 1 adds acceptances


def test_nsd_zero_excess_mass_is_exact():
    """ES = 0 (q <= p on the nucleus): NSD emits exactly p (appendix A.3)."""
    p = torch.softmax(random_logits(120, 1)[0], -1)
    mask = nucleus_mask(p, THETA)
    q = torch.where(mask, 0.7 * p, 0.0)
    q[~mask] += (1 - q.sum()) / (~mask).sum()  # the rest of q's mass outside the nucleus
    assert excess_mass(p, q, THETA).item() == 0.0 and q[~mask].gt(p[~mask]).any()
    drafts = torch.multinomial(q, N, replacement=True, generator=gen(121))[:, None]
    accepted, token, extra = run(torch.stack([p, p]), drafts, seed=122, rule="nucleus", theta=THETA,
                                 draft_probs=q[None])
    assert extra.sum() == 0
    assert_law(torch.bincount(emitted_first(drafts, accepted, token), minlength=V), p, wrong_law=q)


# ------------------------------------------------------------------ general proposer, exact


def test_general_proposer_exact_is_lossless():
    gamma = 2
    g = gen(130)
    p = target_probs(torch.randn(gamma + 1, V, generator=g) * 1.5, 0.9, top_k=6)
    q = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(gamma)], 1)
    accepted, token, extra = run(p, drafts, seed=131, draft_probs=q)
    assert extra.sum() == 0
    assert_law(torch.bincount(emitted_first(drafts, accepted, token), minlength=V), p[0], wrong_law=q[0])
    beta = torch.minimum(p[:gamma], q).sum(-1).double()  # per-position acceptance rate
    k_law = torch.stack([1 - beta[0], beta[0] * (1 - beta[1]), beta[0] * beta[1]])
    assert_law(torch.bincount(accepted, minlength=gamma + 1), k_law, wrong_law=k_law.flip(0))


def test_invalid_inputs_raise():
    logits = torch.zeros(3, V)
    with pytest.raises(ValueError):
        verify(logits, [1])  # gamma + 1 rows expected
    with pytest.raises(ValueError):
        verify(logits, [1, 2], rule="typical")
    with pytest.raises(ValueError):
        verify(logits, [1, 2], rule="nucleus", theta=1.5)
    with pytest.raises(ValueError):
        verify(logits, [1, 2], draft_probs=torch.zeros(3, V))
