"""The speculation cache: blocks pre-drafted for the verification outcomes the drafter expects.

Entries are keyed by request, round and outcome (k, a). An entry made for round r answers only the
Outcome of round r: a block pre-drafted for another round is stale and is never returned.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CacheEntry:
    accepted: int  # k: drafts of the block under verification this entry assumes accepted
    bonus: int  # a: the token it assumes verification commits after them (the next anchor)
    tokens: tuple[int, ...]  # the pre-drafted block for that outcome
    score: float = 0.0  # the proposer's estimate of the outcome's probability
    passes: int = 0  # refinement passes spent on it
    refreshes: int = 0  # context refreshes spent on it
    confidence: tuple[float, ...] = ()  # the proposer's top-1 probability of each token (empty: none)


class SpeculationCache:
    def __init__(self) -> None:
        self._rounds: dict[str, int] = {}  # req_id -> the round its entries answer
        self._entries: dict[str, dict[tuple[int, int], CacheEntry]] = {}

    def fill(self, req_id: str, round_: int, entries: list[CacheEntry]) -> None:
        """Replace the request's entries with those pre-drafted for `round_`."""
        self._rounds[req_id] = round_
        self._entries[req_id] = {(e.accepted, e.bonus): e for e in entries}

    def lookup(self, req_id: str, round_: int, accepted: int, bonus: int) -> CacheEntry | None:
        """The entry for this outcome, if one was pre-drafted for this very round; the request's
        entries are spent either way (the next round needs new ones)."""
        entries = self._entries.pop(req_id, {})
        if self._rounds.pop(req_id, None) != round_:
            return None
        return entries.get((accepted, bonus))

    def drop(self, req_id: str) -> None:
        self._rounds.pop(req_id, None)
        self._entries.pop(req_id, None)

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
