"""Prompt lookup: the longest recent n-gram match of a context's suffix, and the tokens that followed it.

Shared by the drafter's n-gram proposer and the target worker's own lookup (mode auto's cheap strategy).
"""
from __future__ import annotations


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
