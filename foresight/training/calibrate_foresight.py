"""`foresight calibrate-foresight`: fit the outcome-score calibration of JetSpec++ appendix B.1.

Calibration rounds come from speculative decoding of held-out prompts (the project's calibration set, kept
out of every evaluation set) with the real target, at temperatures 0 and 1: before each verification the
foresight drafter predicts the block as in pipelined serving, and the round keeps the features of each draft
position, the bonus candidates of each length and the realised outcome (k, a).

    w     maximum likelihood of the realised accept lengths: positions 1..k are accepted trials, position
          k+1 (if k < gamma) the rejection; a logistic regression over those positions (L-BFGS, light L2)
    beta  maximum likelihood of the realised anchor among its length's candidates (golden-section search
          over log beta); rounds whose anchor is outside the candidates carry no information on beta
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafter_worker.calibration import FEATURES, Calibration, anchor_log_probs, position_features
from ..spec.sampling import target_probs

L2 = 1e-3  # ridge on w (the bias included), per position trial: keeps a short calibration well-posed
BETA_RANGE = (math.log(0.1), math.log(10.0))  # log beta searched over


@dataclass(frozen=True, slots=True)
class CalibrationRound:
    """What one verification tells the calibration."""

    features: torch.Tensor  # [gamma, 6]  phi_i of the drafts
    accepted: int  # realised k
    anchor_logp: torch.Tensor  # [n_cand]  log p_hat(a | k) of the bonus candidates at the realised k
    anchor_index: int  # the realised token among them (-1: not a candidate)


def calibration_round(logits: torch.Tensor, draft: list[int], confidence, accepted: int,
                      token: int) -> CalibrationRound:
    """From the decoder's logits [gamma+1, vocab] over the block, the drafts and their draft-model
    probabilities, and the realised outcome (k = accepted, a = token)."""
    probs = target_probs(logits, 1.0)  # [gamma+1, vocab]  p_hat at temperature 1 (appendix B.1)
    block = torch.tensor(draft, dtype=torch.long)
    row = anchor_log_probs(probs, block)[accepted]  # [vocab]
    candidates = torch.isfinite(row).nonzero().squeeze(-1)  # [n_cand]
    where = (candidates == token).nonzero()
    return CalibrationRound(position_features(probs, block, confidence), accepted, row[candidates].clone(),
                            int(where[0, 0]) if where.numel() else -1)


def acceptance_trials(rounds: list[CalibrationRound]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position a verification reached: features [n, 6] and accepted (1) or rejected (0) [n]."""
    xs, ys = [], []
    for r in rounds:
        gamma = r.features.shape[0]
        reached = min(r.accepted + 1, gamma)
        xs.append(r.features[:reached])
        ys.append(torch.tensor([1.0] * r.accepted + [0.0] * (reached - r.accepted)))
    return torch.cat(xs), torch.cat(ys)


def fit_weights(x: torch.Tensor, y: torch.Tensor, l2: float = L2) -> torch.Tensor:
    """Logistic regression by L-BFGS: w [6] maximising sum log P(y | x) - l2 * n * |w|^2 / 2."""
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    x64, y64 = x.double(), y.double()
    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(x64 @ w, y64) + 0.5 * l2 * (w * w).sum()
        value.backward()
        return value

    opt.step(loss)
    return w.detach()


def anchor_nll(rounds: list[CalibrationRound], log_beta: float) -> float:
    """Mean negative log-likelihood of the realised anchors under P_beta (rounds with a candidate anchor)."""
    beta = math.exp(log_beta)
    total, n = 0.0, 0
    for r in rounds:
        if r.anchor_index >= 0:
            total -= float(torch.log_softmax(r.anchor_logp.double() / beta, dim=-1)[r.anchor_index])
            n += 1
    return total / max(1, n)


def fit_beta(rounds: list[CalibrationRound], steps: int = 40) -> float:
    """Golden-section search of log beta over BETA_RANGE (the likelihood is unimodal in practice)."""
    lo, hi = BETA_RANGE
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = anchor_nll(rounds, a), anchor_nll(rounds, b)
    for _ in range(steps):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = anchor_nll(rounds, a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = anchor_nll(rounds, b)
    return math.exp((lo + hi) / 2)


def fit_calibration(rounds: list[CalibrationRound], source: str = "") -> Calibration:
    if not rounds:
        raise ValueError("calibration: no rounds to fit on")
    x, y = acceptance_trials(rounds)
    w = fit_weights(x, y)
    return Calibration(tuple(float(v) for v in w), fit_beta(rounds), len(rounds), source)


def collect_rounds(runner, drafter, prompts: list[list[int]], max_tokens: int, block_size: int, eos: list[int],
                   temperatures: list[float], log=print) -> list[CalibrationRound]:
    """Speculative decoding of every prompt at every temperature (sync rounds with the drafter's own
    drafts); one CalibrationRound per verification of a non-empty block."""
    from .eval_drafter import speculate

    rounds: list[CalibrationRound] = []

    def keep(ctx, block, result, verdict) -> None:
        _, logits, _ = drafter.predict(ctx, block.tokens)  # [gamma+1, vocab]
        rounds.append(calibration_round(logits, block.tokens, block.confidence, verdict.accepted, verdict.token))

    t0 = time.perf_counter()
    for t in temperatures:
        for i, prompt in enumerate(prompts):
            speculate(runner, drafter, prompt, max_tokens, t, block_size, i, eos, on_verified=keep)
        log(f"[calibrate-foresight] T={t:g}: {len(rounds)} rounds so far ({time.perf_counter() - t0:.0f} s)")
    return rounds


def run_calibrate(args: argparse.Namespace) -> Calibration:
    from ..config import EngineConfig
    from ..drafter_worker.worker import make_proposer
    from ..target_worker.runner import TargetRunner
    from .eval_foresight import load_eval_target

    target, prompts, eos = load_eval_target(args)
    cfg = EngineConfig(target=args.target, drafter=args.drafter, adapter=args.adapter, dtype="float32",
                       decoder_layers=args.decoder_layers, calibration="none")
    drafter = make_proposer(cfg)
    if not getattr(drafter, "supports_foresight", False):
        raise SystemExit(f"calibrate-foresight: {args.drafter} has no adapter (foresight) to calibrate")
    runner = TargetRunner.for_proposer(target, drafter)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rounds = collect_rounds(runner, drafter, prompts, args.max_tokens, args.block_size, eos, temperatures)
    source = (f"{args.prompts}[{args.offset}:{args.offset + len(prompts)}], T={args.temperatures}, "
              f"block {args.block_size}, decoder {drafter.decoder_layers} layers")
    calibration = fit_calibration(rounds, source)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    calibration.save(Path(args.out))
    weights = ", ".join(f"{n}={w:+.3f}" for n, w in zip(FEATURES, calibration.weights))
    print(f"[calibrate-foresight] {len(rounds)} rounds: {weights}; beta={calibration.beta:.3f} -> {args.out}")
    return calibration
