"""The real foresight drafter with scripted drafts, to drive the pipelined protocol on any target.

Everything foresight decides stays real: the adapter's prediction, the decoder over it (on a hybrid
target: from the committed linear-attention state the target sends), the outcome scores and the choice of
outcomes. Only the draft tokens are scripted: the target's own greedy continuation, with the token at
one position replaced (the position cycles with the context length, sometimes none), so verification
ends at every possible outcome (k, a), partial acceptances included. A foresight round hits the cache only
if the decoder named the realised outcome, which at temperature 0 with a perfect (oracle) adapter needs an
exact decoder.
"""
from __future__ import annotations

import random

import torch
from transformers import DynamicCache

from foresight.drafter_worker.decoder_scorer import AdapterDecoderScorer
from foresight.drafter_worker.foresight import ForesightDrafter
from foresight.drafter_worker.proposer import Draft
from foresight.drafter_worker.refinement import Refiner


WIDEST = 8  # corrupted positions are drawn from 0..WIDEST-1 (beyond the draft: none)


class ScriptedForesight(ForesightDrafter):
    def __init__(self, target, draft_model, adapter, decoder, check_decoder: bool = True, **kw):
        """`check_decoder`: compare the decoder's logits of every block with the target's (`decoder_errors`)."""
        super().__init__(draft_model, AdapterDecoderScorer(draft_model, adapter, decoder), passes=0, refinement="none", refreshes=0,
                         use_budget=False, **kw)
        self.target, self.check_decoder = target, check_decoder
        self.vocab = target.config.vocab_size
        self.decoder_stats: dict[str, tuple[int, int]] = {}  # req_id -> (adopted, stale) of its decoder, lately
        self.foresee_calls = 0

        self.decoder_errors: list[float] = []  # per foresight call: max |decoder logits - target logits|

    def foresee(self, ctx, *args, **kw):
        self.foresee_calls += 1
        try:
            return super().foresee(ctx, *args, **kw)
        finally:
            decoder = self.state(ctx).decoder
            self.decoder_stats[ctx.req_id] = (decoder.adopted, decoder.stale)

    @torch.inference_mode()
    def predict_blocks(self, states, ctxs, blocks):
        """The real prediction, each block's decoder logits checked against the target's own after its context."""
        out = super().predict_blocks(states, ctxs, blocks)
        if self.check_decoder:
            for ctx, block, (_, logits, _) in zip(ctxs, blocks, out):
                n = len(ctx.tokens) - 1
                truth = self.target(torch.tensor([ctx.tokens + block])).logits[0, n:].float()  # [gamma+1, vocab]
                self.decoder_errors.append(float((logits - truth).abs().max()))
        return out

    @torch.inference_mode()
    def scripted(self, tokens: list[int], n: int) -> list[int]:
        cache, feed, draft = DynamicCache(config=self.target.config), list(tokens), []
        for _ in range(n):
            draft.append(int(self.target(torch.tensor([feed]), cache=cache).logits[0, -1].argmax()))
            feed = draft[-1:]
        return self.corrupt(tokens, draft)

    def corrupt(self, tokens: list[int], draft: list[int]) -> list[int]:
        """The greedy draft after `tokens` with the token at one position (from len(tokens)) replaced, or
        none; the position does not depend on the draft's length, so a shorter draft is a prefix."""
        wrong = random.Random(len(tokens)).randrange(WIDEST)
        return [(t + 1) % self.vocab if i == wrong else t for i, t in enumerate(draft)]

    def propose_batch(self, ctxs, max_drafts):
        for ctx, wanted in zip(ctxs, max_drafts):
            if wanted > 0:
                self.absorb(ctx, draft_only=True)  # the contexts stay as the real drafter keeps them
        return [Draft(self.scripted(ctx.tokens, m)) if m > 0 else Draft() for ctx, m in zip(ctxs, max_drafts)]

    def _predraft_many(self, parts, stop=None) -> list[Refiner]:
        """Scripted drafts for every request's picked outcomes, no refinement."""
        return [Refiner(self.scorer.bound_rows(p.state, p.n), p.ctx.tokens[-1], p.block, [(o.k, o.a) for o in p.picked],
                        torch.tensor([self.scripted(p.ctx.tokens + p.block[:o.k] + [o.a], p.max_drafts)
                                      for o in p.picked]), "none")
                for p in parts]

