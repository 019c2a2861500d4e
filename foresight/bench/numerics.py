"""The numerics probe: is a greedy speculative output that differs from `ar` explained by a near-tie?

A γ+1-position verify forward and a 1-token step compute the same logits only up to rounding. In bf16
the last hidden state differs between the two shapes by enough to move the top-2 logit margin by up to
~2.4 eps x |top logit| (measured on SmolLM2-135M, docs/numerics.md; the row's largest |logit| is
at least that), so where the target's two best
tokens are that close, the two modes may legitimately choose differently. Everywhere else a mismatch
is a bug.

For each mismatch the probe replays the `ar` run (prefill, then 1-token steps along the ar output, the
shapes `ar` used) up to the first divergence and reads the target's top-2 logit margin there, after the
request's logit rules (penalties, bias, min_tokens) where it has any.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..target_worker.logit_rules import LogitRules
from ..target_worker.steps import ruled_logits

# A margin below NEAR_TIE_EPS x eps(dtype) x (the row's largest |logit|) is a near-tie (eps =
# torch.finfo(dtype).eps). The scale is the row's dynamic range, not the top logit: rounding noise in the
# hidden state moves every logit by an amount that grows with the size of the logits, and a row whose top
# logit happens to lie near 0 (its others far below) is as noisy as any other.
NEAR_TIE_EPS = 4.0


def near_tie_threshold(dtype: torch.dtype, logit_scale: float) -> float:
    """The largest top-2 margin that rounding in `dtype` can flip between forward shapes, for a row whose
    largest |logit| is `logit_scale`."""
    return NEAR_TIE_EPS * torch.finfo(dtype).eps * abs(logit_scale)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (the shorter length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Divergence:
    prompt: int  # index of the prompt
    position: int  # first differing output position
    margin: float  # the ar run's top-1 minus top-2 logit there
    threshold: float  # near_tie_threshold at that position
    replay_faithful: bool  # the replay's argmax reproduced the ar tokens before the divergence

    @property
    def near_tie(self) -> bool:
        return self.margin < self.threshold

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "position": self.position, "margin": round(self.margin, 5),
                "threshold": round(self.threshold, 5), "near_tie": self.near_tie,
                "replay_faithful": self.replay_faithful}


@torch.inference_mode()
def replay_margin(runner, prompt_ids: list[int], ar_tokens: list[int], position: int,
                  rules: LogitRules | None = None) -> tuple[float, float, bool]:
    """(margin, largest finite |logit|, faithful) of the ar run at output `position`, replayed with 1-token
    steps (after `rules`, the request's logit rules, if any)."""
    cache = runner.new_cache()
    logits = ruled_row(runner, runner.prefill(cache, prompt_ids), rules, [])  # [vocab]
    faithful = True
    for i, token in enumerate(ar_tokens[:position]):
        faithful &= int(logits.argmax()) == token
        logits = ruled_row(runner, runner.forward(cache, [token]), rules, ar_tokens[:i + 1])
    finite = logits.float()[logits.isfinite()]  # min_tokens masks the stop tokens with -inf
    top = torch.topk(finite, 2).values
    return float(top[0] - top[1]), float(finite.abs().max()), faithful


def ruled_row(runner, result, rules: LogitRules | None, output_ids: list[int]) -> torch.Tensor:
    """The last row of a forward's logits [vocab], after the request's rules as of `output_ids`."""
    if rules is None:
        return result.logits[-1]
    return ruled_logits(rules, output_ids, result, [], runner.head)[-1]


def probe(runner, dtype: torch.dtype, prompts: list[list[int]], ar_outputs: list[list[int]],
          outputs: list[list[int]], rules: list[LogitRules | None] | None = None) -> list[Divergence]:
    """One Divergence per prompt whose output differs from ar's (`rules`: each prompt's logit rules)."""
    found = []
    for i, (prompt, ar, out) in enumerate(zip(prompts, ar_outputs, outputs)):
        pos = first_divergence(ar, out)
        if pos is None:
            continue
        margin, scale, faithful = replay_margin(runner, prompt, ar, pos, rules[i] if rules else None)
        found.append(Divergence(i, pos, margin, near_tie_threshold(dtype, scale), faithful))
    return found


def summarise(divergences: list[Divergence]) -> dict:
    """The per-mode report fields."""
    near = sum(d.near_tie for d in divergences)
    return {"mismatches": len(divergences), "mismatches_near_tie": near,
            "mismatches_unexplained": len(divergences) - near,
            "mismatch_details": [d.to_dict() for d in divergences]}
