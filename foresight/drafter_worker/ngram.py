"""Prompt-lookup drafting: continue the longest recent n-gram match found in the request's own context.

Needs no model; pays off on code, editing and anything that repeats its input.
"""
from __future__ import annotations

from .proposer import DraftContext


class NgramProposer:
    name = "ngram"
    hidden_layers: list[int] = []
    supports_foresight = False

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, ctx: DraftContext, max_drafts: int) -> list[int]:
        return lookup(ctx.tokens, max_drafts, self.n_max, self.n_min)


def lookup(tokens: list[int], max_drafts: int, n_max: int, n_min: int) -> list[int]:
    """Find the suffix n-gram (longest n first) earlier in `tokens`, most recent occurrence first,
    and return up to `max_drafts` tokens that followed it."""
    if max_drafts <= 0:
        return []
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # Scan right to left so the most recent occurrence wins; start <= length - n - 1
        # keeps the match strictly before the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + max_drafts]
                if follow:
                    return follow
    return []
