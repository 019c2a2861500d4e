"""Test-only foresight proposers built on the target itself (greedy), to drive the pipelined protocol.

`propose` drafts the target's own greedy continuation with every third token corrupted, so
verification ends at varied outcomes (k, a). `foresee` then knows the outcome exactly (it runs the
target), so with `wrong=False` every round is a cache hit and with `wrong=True` every round a miss.
"""
from __future__ import annotations

import torch

from foresight.drafter_worker.proposer import Draft, StatelessProposer
from foresight.drafter_worker.speculation_cache import CacheEntry


class OracleForesight(StatelessProposer):
    name = "oracle"
    supports_foresight = True

    def __init__(self, model, wrong: bool = False):
        self.model = model
        self.wrong = wrong
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
        return [(t + 1) % self.vocab if i % 3 == 2 else t for i, t in enumerate(tokens)]

    def foresee(self, ctx, block: list[int], max_drafts: int, budget_s: float, stop=None,
                confidence=()) -> list[CacheEntry]:
        self.foresee_calls += 1
        truth = self.greedy(ctx.tokens, len(block) + 1)
        k = next((i for i, (d, t) in enumerate(zip(block, truth)) if d != t), len(block))
        a = truth[k] if not self.wrong else (truth[k] + 1) % self.vocab
        draft = self.propose_after(ctx.tokens + block[:k] + [a], max_drafts)
        return [CacheEntry(accepted=k, bonus=a, tokens=tuple(draft), score=1.0, passes=1)]

    def propose_after(self, tokens: list[int], max_drafts: int) -> list[int]:
        return self._corrupt(self.greedy(tokens, max_drafts))
