"""Prompt-lookup drafting: continue the longest recent n-gram match found in the request's own context.

Needs no model; pays off on code, editing and anything that repeats its input.
"""
from __future__ import annotations

from .proposer import Draft, DraftContext, StatelessProposer


class NgramProposer(StatelessProposer):
    name = "ngram"
    supports_foresight = False

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        return Draft(lookup(ctx.tokens, max_drafts, self.n_max, self.n_min))


def lookup(tokens: list[int], max_drafts: int, n_max: int, n_min: int) -> list[int]:
    """Find the suffix n-gram (longest n first) earlier in `tokens` and return up to `max_drafts` tokens
    that followed it: from the most recent occurrence with a full `max_drafts` after it, else from the one
    with the longest continuation (inside a run of repeated tokens the most recent occurrence is followed
    by one token only, an earlier one by the whole run)."""
    return lookup_match(tokens, max_drafts, n_max, n_min)[0]


def lookup_match(tokens: list[int], max_drafts: int, n_max: int, n_min: int) -> tuple[list[int], int]:
    """`lookup`, and the length n of the n-gram that matched (0: none)."""
    if max_drafts <= 0:
        return [], 0
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        best: list[int] = []
        # Right to left so the most recent occurrence wins; start <= length - n - 1 keeps the match
        # strictly before the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + max_drafts]
                if len(follow) == max_drafts:
                    return follow, n
                if len(follow) > len(best):
                    best = follow
        if best:
            return best, n
    return [], 0
