"""Outcome scores (JetSpec++ Eq. 6), Proposition 1, and outcome selection (Eq. 7).

Proposition 1: with a perfect decoder, P(k, a) is the exact law of the verification outcome (k, a).
We check it against `verify_batch` by Monte Carlo, with a chi-square goodness-of-fit test, and show
that the same statistic rejects plausible wrong formulas.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from foresight.models.decoder import ForesightDecoder
from foresight.drafter_worker.outcomes import hit_probability, outcome_scores, select_outcomes
from foresight.spec.sampling import target_probs
from foresight.spec.verification import in_nucleus, verify, verify_batch
from support.tiny_models import VOCAB, tiny_model

torch.set_num_threads(1)

GAMMA = 3
TRIALS = 40_000
MIN_EXPECTED = 5.0  # chi-square cells: outcomes with N*P >= 5 each; the rest pooled into one cell
# Noise floor: the correct law must give a p-value above P_PASS (a false alarm is a 1e-4 event; the
# seeds are fixed, so the test is deterministic); a wrong law must fall below P_REJECT.
P_PASS, P_REJECT = 1e-4, 1e-12


def chi_square_pvalue(expected_law: torch.Tensor, counts: torch.Tensor) -> float:
    """p-value of the observed outcome counts [gamma+1, vocab] under `expected_law` [gamma+1, vocab].

    An outcome observed although the law gives it probability 0 rejects outright (p = 0).
    """
    law = expected_law.double().flatten() / expected_law.double().sum()
    obs = counts.double().flatten()
    n = obs.sum()
    if bool((obs[law == 0] > 0).any()):
        return 0.0
    exp = n * law
    big = exp >= MIN_EXPECTED
    cells_exp = torch.cat([exp[big], exp[~big].sum()[None]])
    cells_obs = torch.cat([obs[big], obs[~big].sum()[None]])
    if cells_exp[-1] < MIN_EXPECTED:  # too little pooled mass to form its own cell: merge it
        cells_exp[-2] += cells_exp[-1]
        cells_obs[-2] += cells_obs[-1]
        cells_exp, cells_obs = cells_exp[:-1], cells_obs[:-1]
    stat = float(((cells_obs - cells_exp) ** 2 / cells_exp).sum())
    return float(chi2.sf(stat, df=len(cells_exp) - 1))


@pytest.fixture(scope="module")
def block():
    """Target logits [gamma+1, vocab] for [anchor, d_1..d_3] on a tiny Llama, and the true decoder input.

    The tiny model mostly repeats its last token, so the drafts take ranks (0, 1, 0) of the target at
    each prefix: d_1 and d_3 are likely, d_2 is the runner-up; every k has mass and the rows differ
    (row 2 follows an unlikely token). At temperature 1 the lengths k = 0..3 carry about
    0.51 / 0.46 / 0.013 / 0.015 of the mass.
    """
    model = tiny_model("llama")
    seq = torch.randint(0, VOCAB - 1, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    n = len(seq) - 1  # position of the anchor seq[-1]
    with torch.inference_mode():
        for rank in (0, 1, 0):
            row = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.sort(row, descending=True, stable=True).indices[rank]))
        dec = ForesightDecoder(model, 2)
        out = model(torch.tensor([seq]), output_hidden_states=[dec.input_index])
    logits = out.logits[0, n:].float()  # [gamma+1, vocab]
    states = out.hidden_states[dec.input_index][0]  # [n+gamma+1, hidden]
    cache = dec.new_cache()
    dec.extend_context(cache, states[:n], 0)
    dec_probs = dec.score(cache, states[n:])  # the perfect decoder: true states in
    return logits, torch.tensor(seq[n + 1:]), dec_probs


def empirical_counts(probs: torch.Tensor, draft: torch.Tensor, seed: int, **rule) -> torch.Tensor:
    """Outcome counts [gamma+1, vocab] of TRIALS independent verifications of one block (`rule`: the
    verification rule's arguments of `verify_batch`, default exact)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(probs.shape, dtype=torch.long)
    for chunk in range(0, TRIALS, 10_000):
        b = min(10_000, TRIALS - chunk)
        k, a, _ = verify_batch(probs.expand(b, -1, -1), draft.expand(b, -1), generator=gen, **rule)
        counts.index_put_((k, a), torch.ones_like(k), accumulate=True)
    return counts


def test_perfect_decoder_equals_target(block):
    logits, _, dec_probs = block
    torch.testing.assert_close(dec_probs, target_probs(logits, 1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_proposition_1_scores_are_the_outcome_law(block, sampling):
    """P(k, a) from a perfect decoder = frequency of (k, a) under verification; wrong laws are rejected."""
    logits, draft, dec_probs = block
    temperature, top_k, top_p = sampling
    p = target_probs(logits, temperature, top_k, top_p)  # [gamma+1, vocab]
    # Perfect decoder at the sampling temperature (at temperature 1 without truncation: the decoder's rows).
    perfect = dec_probs if sampling == (1.0, 0, 1.0) else p
    scores = outcome_scores(perfect, draft)
    law = scores.dense()  # [gamma+1, vocab]
    assert abs(float(law.double().sum()) - 1.0) < 1e-5  # all outcomes: total mass 1
    assert float(law.sum(-1).min()) > 1e-3  # every length k is realised (>= 40 expected hits)

    counts = empirical_counts(p, draft, seed=1)
    assert int(counts.sum()) == TRIALS
    assert chi_square_pvalue(law, counts) > P_PASS

    # Per outcome, the ten likeliest: binomial z within 4.5 (joint false-alarm rate < 1e-4).
    freq = counts.double() / TRIALS
    top = torch.topk(law.flatten(), 10).indices
    sigma = (law.flatten()[top].double() * (1 - law.flatten()[top].double()) / TRIALS).sqrt()
    assert bool(((freq.flatten()[top] - law.flatten()[top].double()).abs() <= 4.5 * sigma).all())

    # The same statistic rejects wrong formulas (each renormalised to a distribution):
    rows = torch.arange(GAMMA)
    no_exclusion = scores.prefix[:, None] * perfect  # forgot a != d_{k+1}
    reject_factor = torch.ones(GAMMA + 1)
    reject_factor[:GAMMA] = 1 - perfect[rows, draft]
    no_cancellation = law * reject_factor[:, None]  # kept 1 - p(d_{k+1}) without the residual's normaliser
    shifted = scores.prefix[:, None] * torch.cat([perfect[1:], perfect[-1:]])  # row k+1 for the anchor
    shifted[rows, draft] = 0.0
    for wrong in (no_exclusion, no_cancellation, shifted):
        assert chi_square_pvalue(wrong, counts) < P_REJECT


@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0, 0.3), (0.7, 20, 0.9, 0.95)])
def test_proposition_1_under_nucleus_verification(block, sampling):
    """Under nucleus verification a draft inside the target's nucleus is always accepted: scored with
    those drafts as sure, P(k, a) is again the law of the outcome; the exact rule's scores are not."""
    logits, draft, _ = block
    temperature, top_k, top_p, theta = sampling
    p = target_probs(logits, temperature, top_k, top_p)  # [gamma+1, vocab]
    sure = in_nucleus(p[:GAMMA], draft, theta)  # [gamma]
    assert sure.tolist() == [True, False, True]  # the runner-up d_2 lies outside: both kinds of draft
    law = outcome_scores(p, draft, sure).dense()
    assert abs(float(law.double().sum()) - 1.0) < 1e-5
    assert float(law[0].sum()) == 0.0 and float(law[2].sum()) == 0.0  # sure drafts are never rejected
    counts = empirical_counts(p, draft, seed=3, rule="nucleus", theta=theta)
    assert chi_square_pvalue(law, counts) > P_PASS
    assert chi_square_pvalue(outcome_scores(p, draft).dense(), counts) < P_REJECT


def test_single_block_verify_lands_on_scored_outcomes(block):
    """`verify` (the one-request path) only ever ends at outcomes of positive score."""
    logits, draft, dec_probs = block
    law = outcome_scores(dec_probs, draft).dense()
    for seed in range(50):
        v = verify(logits, draft.tolist(), temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert law[v.accepted, v.token] > 0


def test_paper_worked_example():
    """Appendix F.1: gamma=2, p_hat_1 = 0.8, then d_2 has 0.5 and b has 0.3: P(1, b) = 0.24."""
    vocab, d1, d2, b = 5, 0, 1, 2
    dec = torch.tensor([[0.8, 0.05, 0.05, 0.05, 0.05],
                        [0.1, 0.5, 0.3, 0.05, 0.05],
                        [0.2, 0.2, 0.2, 0.2, 0.2]])
    s = outcome_scores(dec, [d1, d2])
    assert s.prefix.tolist() == pytest.approx([1.0, 0.8, 0.4])
    assert float(s.dense()[1, b]) == pytest.approx(0.24)
    assert float(s.dense()[0, d1]) == 0.0 and float(s.dense()[1, d2]) == 0.0
    assert float(s.dense()[2, d1]) == pytest.approx(0.08)  # all accepted: bonus from row 2
    assert float(s.dense().sum()) == pytest.approx(1.0)
    assert s.anchor.shape == (3, vocab)


def random_scores(gamma=4, vocab=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dec = torch.softmax(3 * torch.randn(gamma + 1, vocab, generator=gen), -1)
    draft = dec[:gamma].argmax(-1)  # likely drafts, so every k carries mass
    return outcome_scores(dec, draft), draft


@pytest.mark.parametrize("B", [1, 5, 16, 32])
def test_select_returns_the_B_best(B):
    scores, draft = random_scores()
    dense = scores.dense()
    ranked = sorted(((-float(dense[k, a]), k, a) for k in range(dense.shape[0]) for a in range(dense.shape[1])
                     if dense[k, a] > 0))
    picked = select_outcomes(scores, B)
    assert [(o.k, o.a) for o in picked] == [(k, a) for _, k, a in ranked[:B]]
    assert all(o.score == pytest.approx(-s) for o, (s, _, _) in zip(picked, ranked))
    assert all(o.a != int(draft[o.k]) for o in picked if o.k < len(draft))  # (k, d_{k+1}) is not an outcome
    assert hit_probability(picked) == pytest.approx(-sum(s for s, _, _ in ranked[:B]), rel=1e-5)
    assert select_outcomes(scores, B) == picked  # deterministic


def test_select_ties_are_deterministic():
    """Uniform rows: every candidate of a row ties; order is by score, then k, then token id."""
    dec = torch.full((3, 50), 1 / 50)
    scores = outcome_scores(dec, [7, 3])
    picked = select_outcomes(scores, 60, top_per_row=4)
    # Row 0 (score 1/50) first: tokens 0..4 without d_1 = 7 -> 0,1,2,3; then row 1 (1/2500), row 2 (same).
    assert [(o.k, o.a) for o in picked] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                            (1, 0), (1, 1), (1, 2), (1, 4),
                                            (2, 0), (2, 1), (2, 2), (2, 3)]
    assert select_outcomes(scores, 60, top_per_row=4) == picked


def test_all_outcomes_hit_probability_one():
    scores, _ = random_scores(gamma=5, vocab=300, seed=1)
    everything = select_outcomes(scores, 10**9, top_per_row=None)
    assert hit_probability(everything) == pytest.approx(1.0, abs=1e-5)
    assert len(everything) == int((scores.dense() > 0).sum())
    assert select_outcomes(scores, 0) == []


def test_gamma_zero():
    dec = torch.softmax(torch.randn(1, 20, generator=torch.Generator().manual_seed(2)), -1)
    scores = outcome_scores(dec, [])
    torch.testing.assert_close(scores.dense(), dec)
    assert select_outcomes(scores, 1)[0].a == int(dec[0].argmax())


@pytest.mark.parametrize("case", range(40))
def test_ranking_over_the_candidate_columns_picks_what_the_whole_vocabulary_picks(case):
    """`rank_outcomes` scores only `candidate_columns` (~300 of the vocabulary): the outcomes, their order and scores
    must be the whole vocabulary's, with Eq. 6 or calibrated scores, the greedy path, the nucleus gate, top-k zeros
    and the ties bf16 logits make (every token tied at a row's cut is a column)."""
    from foresight.drafter_worker.calibration import Calibration
    from foresight.drafter_worker.outcome_selection import rank_outcomes
    from foresight.spec.sampling import target_probs

    g = torch.Generator().manual_seed(case)
    gamma, vocab = int(torch.randint(0, 8, (1,), generator=g)), 3000
    logits = torch.randn(gamma + 1, vocab, generator=g) * 4
    if case % 2:
        logits = logits.bfloat16().float()  # coarse values: many ties
    if case % 5 == 0:
        logits[:, 40:80] = logits.max() + 1.0  # 40 tokens tied at the top of every row: the whole vocabulary
    probs = target_probs(logits, 1.0, 50 if case % 3 == 0 else 0, 1.0)  # [gamma+1, vocab]
    block = [int(logits[i].argmax()) if case % 4 else int(torch.randint(0, vocab, (1,), generator=g))
             for i in range(gamma)]
    calibration = Calibration((0.5, 1.0, 0.3, -0.2, -0.1, 0.2), 0.8) if case % 2 == 0 else None
    sure = torch.rand(gamma, generator=g) < 0.3 if case % 7 == 0 else None
    greedy = logits.argmax(-1).tolist() if case % 3 == 1 else None
    kw = dict(calibration=calibration, confidence=[0.4] * gamma, sure=sure, greedy_top=greedy)
    for B in (1, 4, 16):
        got, whole = rank_outcomes(probs, block, B, **kw), rank_outcomes(probs, block, B, whole_vocab=True, **kw)
        assert [(o.k, o.a) for o in got] == [(o.k, o.a) for o in whole], B
        # a calibrated softmax sums over fewer columns: the same scores up to float rounding
        assert [o.score for o in got] == pytest.approx([o.score for o in whole], rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("case", range(30))
def test_selection_over_the_scorers_vocabulary_picks_what_the_whole_vocabulary_picks(case):
    """A scorer's logits are -inf outside its vocabulary (the draft model's subset): selecting over those columns
    alone picks the same outcomes, in the same order, with the same scores, under every verification setting; a
    block with a draft outside them (a prompt-lookup block) is scored over the whole vocabulary."""
    from foresight.drafter_worker.calibration import Calibration
    from foresight.drafter_worker.outcome_selection import select_for_request
    from foresight.protocol.messages import SamplingParams

    g = torch.Generator().manual_seed(100 + case)
    gamma, vocab = int(torch.randint(0, 8, (1,), generator=g)), 3000
    columns = torch.sort(torch.randperm(vocab, generator=g)[:900]).values
    logits = torch.full((gamma + 1, vocab), float("-inf"))
    logits[:, columns] = torch.randn(gamma + 1, len(columns), generator=g) * 4
    if case % 2:
        logits = logits.bfloat16().float()  # ties
    inside = [int(columns[int(logits[i, columns].argmax())]) for i in range(gamma)]
    block = inside if case % 4 or not gamma else inside[:-1] + [int(torch.randint(0, vocab, (1,), generator=g))]
    sampling = SamplingParams(temperature=[0.0, 0.7, 1.0][case % 3], top_k=40 if case % 5 == 0 else 0,
                              top_p=0.9 if case % 6 == 1 else 1.0,
                              verification="nucleus" if case % 7 == 0 else "exact", nucleus_threshold=0.5)
    kw = dict(calibration=Calibration((0.5, 1.0, 0.3, -0.2, -0.1, 0.2), 0.8) if case % 2 == 0 else None,
              confidence=[0.4] * gamma, greedy_first=True)
    for B in (1, 4, 16):
        got = select_for_request(logits, block, B, sampling.temperature, sampling, columns=columns, **kw)
        whole = select_for_request(logits, block, B, sampling.temperature, sampling, **kw)
        assert [(o.k, o.a) for o in got] == [(o.k, o.a) for o in whole], B
        assert [o.score for o in got] == pytest.approx([o.score for o in whole], rel=1e-5, abs=1e-12)
        assert all(o.a in set(columns.tolist()) for o in got)
