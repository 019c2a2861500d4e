"""Prompt-lookup drafting: continue the longest recent n-gram match found in the request's own context.

Needs no model; pays off on code, editing and anything that repeats its input.
"""
from __future__ import annotations

from ..spec.ngram import lookup
from .proposer import Draft, DraftContext, StatelessProposer


class NgramProposer(StatelessProposer):
    name = "ngram"
    supports_foresight = False

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        return Draft(lookup(ctx.tokens, max_drafts, self.n_max, self.n_min))
