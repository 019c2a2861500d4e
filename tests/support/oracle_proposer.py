"""Test-only foresight proposers built on the target itself (greedy), to drive the pipelined protocol.

`propose` drafts the target's own greedy continuation with every third token corrupted, so
verification ends at varied outcomes (k, a); with `cuts=` a seed, the corrupted position is drawn per draft
instead (or none is), so rounds reject every possible number of drafts, all of them and none included. `foresee` then knows the outcome exactly (it runs the
target), so with `wrong=False` every round is a cache hit and with `wrong=True` every round a miss.
"""
from __future__ import annotations

import copy
import random

import torch

from foresight.drafter_worker.proposer import Draft, StatelessProposer, foresee_each
from foresight.drafter_worker.speculation_cache import CacheEntry


class OracleForesight(StatelessProposer):
    name = "oracle"
    supports_foresight = True

    def __init__(self, model, wrong: bool = False, cuts: int | None = None, share: bool = False):
        # A copy: in-process, the drafter's thread runs it while the target's thread runs the target, whose
        # forwards hook its modules (a hybrid target captures its mixers' inputs for rollback, a bf16 one its
        # final norm's). `share`: run `model` itself, for a model that cannot be copied (oneDNN's packed
        # tensors) and that no forward hooks.
        self.model = model if share else copy.deepcopy(model)
        self.wrong = wrong
        self.cuts = None if cuts is None else random.Random(cuts)
        self.vocab = model.config.vocab_size
        self.foresee_calls = 0

    @torch.inference_mode()
    def greedy(self, tokens: list[int], n: int) -> list[int]:
        ids = list(tokens)
        for _ in range(n):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(tokens):]

    def propose(self, ctx, max_drafts: int) -> Draft:
        return Draft(self._corrupt(self.greedy(ctx.tokens, max_drafts)))

    def _corrupt(self, tokens: list[int]) -> list[int]:
        if self.cuts is None:
            return [(t + 1) % self.vocab if i % 3 == 2 else t for i, t in enumerate(tokens)]
        cut = self.cuts.randint(0, len(tokens))  # len(tokens): nothing corrupted, the whole draft is right
        return [(t + 1) % self.vocab if i == cut else t for i, t in enumerate(tokens)]

    def foresee(self, ctx, block: list[int], max_drafts: int, budget_s: float, stop=None,
                confidence=()) -> list[CacheEntry]:
        self.foresee_calls += 1
        truth = self.greedy(ctx.tokens, len(block) + 1)
        k = next((i for i, (d, t) in enumerate(zip(block, truth)) if d != t), len(block))
        a = truth[k] if not self.wrong else (truth[k] + 1) % self.vocab
        draft = self.propose_after(ctx.tokens + block[:k] + [a], max_drafts)
        return [CacheEntry(accepted=k, bonus=a, tokens=tuple(draft), score=1.0, passes=1)]

    def foresee_batch(self, ctxs, blocks, max_drafts, budget_s, stop=None, confidences=None):
        return foresee_each(self, ctxs, blocks, max_drafts, budget_s, stop, confidences)

    def catch_up(self, ctx, stop) -> bool:
        return True  # it keeps nothing to catch up on

    def propose_after(self, tokens: list[int], max_drafts: int) -> list[int]:
        return self._corrupt(self.greedy(tokens, max_drafts))
