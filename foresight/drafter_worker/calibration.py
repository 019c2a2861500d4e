"""Calibrated outcome scores (JetSpec++ appendix B.1).

The decoder's Eq. 6 scores multiply its acceptance estimates p_hat_i = p_hat(d_i | i-1); its errors compound
along the block. The calibrated rule replaces each factor by a logistic function of six features of the
position,

    p_tilde_i = sigmoid(w . phi_i)
    phi_i     = (logit q_i, logit p_hat_i, [d_i = argmax p_hat(. | i-1)],
                 logit max_{a != d_i} p_hat(a | i-1) / (1 - p_hat_i), i / 14, 1)

where q_i is the draft model's own top-1 probability of d_i in its final pass, and the bonus factor by the
decoder's distribution at length k tempered by an anchor temperature beta, renormalised over its top 32
tokens with d_{k+1} removed:

    P_tilde(k, a) = prod_{i<=k} p_tilde_i * (1 - p_tilde_{k+1}) * P_beta(a | k)     (k < gamma; no last factor
                                                                                    at k = gamma)

w is fit by maximum likelihood of the realised accept lengths (each position a verification reached is one
Bernoulli trial: accepted or the first rejection), beta by maximum likelihood of the realised anchors, on
calibration rounds of held-out prompts (`foresight calibrate-foresight`). Calibration changes which outcomes
are pre-drafted, never what is verified or committed.

A block whose drafts carry no draft-model probability (rows reshaped by refinement) uses p_hat_i in place of
q_i: both estimate the same acceptance.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..config import ConfigError
from .outcomes import OutcomeScores, top_tokens

__all__ = ["Calibration", "position_features", "calibrated_scores", "anchor_log_probs", "FEATURES"]

FEATURES = ("draft_logit", "decoder_logit", "decoder_top", "rival_logit", "position", "bias")
POSITION_SCALE = 14.0  # the paper's i / 14
ANCHOR_TOP = 32  # bonus candidates per length (as select_outcomes)
_EPS = 1e-6  # probabilities are clamped to [eps, 1 - eps] before the logit
FILE_NAME = "calibration.json"


@dataclass(frozen=True, slots=True)
class Calibration:
    weights: tuple[float, ...]  # one per FEATURES
    beta: float  # anchor temperature
    rounds: int = 0  # calibration rounds it was fit on
    source: str = ""  # what it was fit on (prompts, decoder depth)

    def __post_init__(self):
        if len(self.weights) != len(FEATURES) or not all(math.isfinite(w) for w in self.weights):
            raise ConfigError(f"calibration: weights must be {len(FEATURES)} finite numbers ({', '.join(FEATURES)})")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"calibration: beta must be a positive number, got {self.beta}")

    def acceptance(self, features: torch.Tensor) -> torch.Tensor:
        """p_tilde [...] from features [..., 6]."""
        return torch.sigmoid(features @ torch.tensor(self.weights, dtype=features.dtype))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"features": list(FEATURES), "weights": list(self.weights),
                                          "beta": self.beta, "rounds": self.rounds, "source": self.source},
                                         indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"calibration: cannot read {path}: {e}") from e
        if raw.get("features") != list(FEATURES):
            raise ConfigError(f"calibration: {path} was fit on features {raw.get('features')}, expected {list(FEATURES)}")
        return cls(tuple(float(w) for w in raw["weights"]), float(raw["beta"]), int(raw.get("rounds", 0)),
                   str(raw.get("source", "")))


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(_EPS, 1 - _EPS)
    return torch.log(p) - torch.log1p(-p)


def position_features(probs: torch.Tensor, draft: torch.Tensor, confidence: Sequence[float] = ()) -> torch.Tensor:
    """phi_i for i = 1..gamma: probs [gamma+1, vocab] (p_hat rows), draft [gamma] -> [gamma, 6].
    `confidence` [gamma]: q_i, the draft model's probability of each draft (empty: p_hat_i stands in)."""
    gamma = draft.shape[0]
    rows = probs[:gamma].float()  # [gamma, vocab]
    p_d = rows.gather(-1, draft[:, None]).squeeze(-1)  # [gamma]  p_hat_i
    top2 = torch.topk(rows, 2, dim=-1)  # [gamma, 2]
    is_top = top2.indices[:, 0] == draft  # [gamma]
    rival = torch.where(is_top, top2.values[:, 1], top2.values[:, 0]) / (1 - p_d).clamp_min(_EPS)  # [gamma]
    q = torch.tensor(list(confidence), dtype=torch.float32) if len(confidence) == gamma else p_d
    position = torch.arange(1, gamma + 1, dtype=torch.float32) / POSITION_SCALE
    return torch.stack([_logit(q), _logit(p_d), is_top.float(), _logit(rival), position,
                        torch.ones(gamma)], dim=-1)


def anchor_log_probs(probs: torch.Tensor, draft: torch.Tensor, top: int = ANCHOR_TOP):
    """Each length's bonus candidates: log p_hat(a | k) over its `top` most probable tokens with d_{k+1}
    removed (-inf elsewhere): [gamma+1, vocab]."""
    gamma = draft.shape[0]
    rows = probs.float().clone()  # [gamma+1, vocab]
    rows[torch.arange(gamma), draft] = 0.0
    keep = top_tokens(rows, min(top, rows.shape[-1])) & (rows > 0)  # [gamma+1, vocab]
    return torch.where(keep, torch.log(rows.clamp_min(1e-30)), torch.full_like(rows, -math.inf))


def calibrated_scores(probs: torch.Tensor, draft, calibration: Calibration, confidence: Sequence[float] = (),
                      sure: torch.Tensor | None = None) -> OutcomeScores:
    """The calibrated P_tilde(k, a), factorised as `outcome_scores` returns Eq. 6: prefix [gamma+1] = G(k),
    anchor [gamma+1, vocab] = (1 - p_tilde_{k+1}) P_beta(a | k). `sure` [gamma]: drafts the nucleus gate
    accepts whenever reached (their factor is 1, and no outcome ends before them)."""
    draft = torch.as_tensor(draft, dtype=torch.long).reshape(-1)  # [gamma]
    gamma = draft.shape[0]
    if probs.dim() != 2 or probs.shape[0] != gamma + 1:
        raise ValueError(f"probs must be [gamma+1, vocab] = [{gamma + 1}, V], got {tuple(probs.shape)}")
    accept = calibration.acceptance(position_features(probs, draft, confidence))  # [gamma]
    if sure is not None:
        accept = torch.where(sure, torch.ones_like(accept), accept)
    prefix = torch.cat([accept.new_ones(1), torch.cumprod(accept, dim=0)])  # [gamma+1]
    anchor = torch.softmax(anchor_log_probs(probs, draft) / calibration.beta, dim=-1)  # [gamma+1, vocab]
    anchor = torch.nan_to_num(anchor)  # a row without candidates (every token but d_{k+1} at 0)
    anchor[:gamma] *= (1 - accept)[:, None]
    return OutcomeScores(prefix=prefix, anchor=anchor)
