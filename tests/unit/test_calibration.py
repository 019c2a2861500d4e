"""Calibrated outcome scores (JetSpec++ appendix B.1) and their fit.

The calibrated rule must be a proper outcome law (scores sum to 1), reduce to Eq. 6 when its weights copy
the decoder's acceptance and beta is 1, honour the nucleus gate, and its fit must recover the weights and
the anchor temperature that generated synthetic calibration rounds.
"""
from __future__ import annotations

import math

import pytest
import torch

from foresight.config import ConfigError
from foresight.drafter_worker.calibration import (FEATURES, Calibration, calibrated_scores, position_features)
from foresight.drafter_worker.outcomes import outcome_scores, select_outcomes
from foresight.training.calibrate_foresight import (CalibrationRound, acceptance_trials, calibration_round,
                                                    fit_beta, fit_calibration, fit_weights)

IDENTITY = Calibration((0.0, 1.0, 0.0, 0.0, 0.0, 0.0), beta=1.0)  # p_tilde_i = p_hat_i


def random_rows(gamma: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(gamma + 1, vocab, generator=g), dim=-1)  # [gamma+1, vocab]
    draft = torch.randint(0, vocab, (gamma,), generator=g)  # [gamma]
    return probs, draft


@pytest.mark.parametrize("weights", [IDENTITY.weights, (0.5, -0.3, 1.0, -0.7, -2.0, 0.4)])
def test_calibrated_scores_are_an_outcome_law(weights):
    probs, draft = random_rows(gamma=6, vocab=50)
    conf = torch.rand(6).tolist()
    scores = calibrated_scores(probs, draft, Calibration(weights, beta=0.7), conf)
    assert scores.dense().sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (scores.dense()[torch.arange(6), draft] == 0).all()  # (k, d_{k+1}) is acceptance, not an outcome


def test_identity_calibration_is_eq6():
    """Weights that copy logit(p_hat_i) and beta = 1 over a vocabulary inside the top 32: Eq. 6 exactly."""
    probs, draft = random_rows(gamma=5, vocab=30)
    cal = calibrated_scores(probs, draft, IDENTITY)
    eq6 = outcome_scores(probs, draft)
    torch.testing.assert_close(cal.dense(), eq6.dense(), atol=1e-5, rtol=1e-4)
    assert [(o.k, o.a) for o in select_outcomes(cal, 8)] == [(o.k, o.a) for o in select_outcomes(eq6, 8)]


def test_nucleus_gate_makes_a_draft_sure():
    probs, draft = random_rows(gamma=4, vocab=40)
    sure = torch.tensor([False, True, False, False])
    scores = calibrated_scores(probs, draft, Calibration((0.2, 0.5, 0.3, -0.2, -1.0, 0.1), 1.3), sure=sure)
    assert scores.prefix[2] == pytest.approx(scores.prefix[1].item())  # d_2's factor is 1
    assert scores.anchor[1].sum() == 0  # no outcome ends at length 1: d_2 is never rejected
    assert scores.dense().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_features_and_missing_confidence():
    probs, draft = random_rows(gamma=3, vocab=20)
    probs[0] = torch.full((20,), 0.01)
    probs[0, draft[0]] = 0.81  # d_1 is the top token with p_hat 0.81; its best rival 0.01 / 0.19
    f = position_features(probs, draft, [0.9, 0.5, 0.2])
    assert f.shape == (3, len(FEATURES))
    assert f[0, 0].item() == pytest.approx(math.log(0.9 / 0.1), rel=1e-4)
    assert f[0, 1].item() == pytest.approx(math.log(0.81 / 0.19), rel=1e-4)
    assert f[0, 2].item() == 1.0
    assert f[0, 3].item() == pytest.approx(math.log((0.01 / 0.19) / (1 - 0.01 / 0.19)), rel=1e-3)
    assert f[:, 4].tolist() == pytest.approx([1 / 14, 2 / 14, 3 / 14]) and f[:, 5].tolist() == [1.0] * 3
    missing = position_features(probs, draft, [])  # no draft-model probabilities: p_hat stands in
    torch.testing.assert_close(missing[:, 0], missing[:, 1])


def synthetic_rounds(w_true: torch.Tensor, beta_true: float, n: int, gamma: int = 6) -> list[CalibrationRound]:
    g = torch.Generator().manual_seed(1)
    rounds = []
    for _ in range(n):
        feats = torch.randn(gamma, 6, generator=g)
        feats[:, 2] = (feats[:, 2] > 0).float()
        feats[:, 4] = torch.arange(1, gamma + 1) / 14
        feats[:, 5] = 1.0
        accept = torch.sigmoid(feats @ w_true)
        k = 0
        while k < gamma and torch.rand(1, generator=g).item() < accept[k]:
            k += 1
        logp = torch.log_softmax(2 * torch.randn(32, generator=g), dim=-1)
        a = int(torch.multinomial(torch.softmax(logp / beta_true, -1), 1, generator=g))
        rounds.append(CalibrationRound(feats, k, logp, a))
    return rounds


def test_fit_recovers_weights_and_beta():
    w_true = torch.tensor([0.8, 0.6, 0.5, -0.4, -1.5, 0.7])
    rounds = synthetic_rounds(w_true, beta_true=1.6, n=4000)
    x, y = acceptance_trials(rounds)
    assert y.numel() == sum(min(r.accepted + 1, 6) for r in rounds)  # every reached position, one trial
    w = fit_weights(x, y, l2=0.0)
    torch.testing.assert_close(w.float(), w_true, atol=0.15, rtol=0)
    assert fit_beta(rounds) == pytest.approx(1.6, rel=0.1)
    cal = fit_calibration(rounds, source="synthetic")
    assert cal.rounds == 4000 and cal.source == "synthetic"


def test_calibration_round_from_logits():
    logits = torch.randn(4, 50)
    draft = logits[:3].argmax(-1).tolist()  # each draft the row's top token
    draft[1] = (draft[1] + 1) % 50  # ... except d_2: rejected, k = 1
    token = int(logits[1].topk(2).indices[1]) if int(logits[1].argmax()) == draft[1] else int(logits[1].argmax())
    r = calibration_round(logits, draft, [0.9, 0.8, 0.7], accepted=1, token=token)
    assert r.features.shape == (3, 6) and r.accepted == 1
    assert r.anchor_logp.numel() == 32 and r.anchor_index >= 0
    assert r.anchor_logp[r.anchor_index] == r.anchor_logp.max()  # the realised token is row 1's best rival


def test_save_load_and_bad_files(tmp_path):
    cal = Calibration((0.1, 0.2, 0.3, 0.4, 0.5, 0.6), beta=1.2, rounds=7, source="x")
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    (tmp_path / "bad.json").write_text('{"features": ["a"], "weights": [1], "beta": 1}')
    with pytest.raises(ConfigError, match="fit on features"):
        Calibration.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="beta must be a positive"):
        Calibration((0.0,) * 6, beta=0.0)
    with pytest.raises(ConfigError, match="cannot read"):
        Calibration.load(tmp_path / "missing.json")
