"""The speculation cache: blocks pre-drafted for the verification outcomes the drafter expects.

Each request keeps its own (`DraftContext.foreseen`), keyed by round and outcome (k, a). An entry made for
round r answers only the Outcome of round r: a block pre-drafted for another round is stale and is never
returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class CacheEntry:
    accepted: int  # k: drafts of the block under verification this entry assumes accepted
    bonus: int  # a: the token it assumes verification commits after them (the next anchor)
    tokens: tuple[int, ...]  # the pre-drafted block for that outcome
    score: float = 0.0  # the proposer's estimate of the outcome's probability
    passes: int = 0  # refinement passes spent on it
    refreshes: int = 0  # context refreshes spent on it
    confidence: tuple[float, ...] = ()  # the proposer's top-1 probability of each token (empty: none)


@dataclass(slots=True)
class ForeseenBlocks:
    """One request's pre-drafted blocks: those for one round, by outcome."""

    round: int = -1  # the round whose Outcome they answer (-1: none)
    entries: dict[tuple[int, int], CacheEntry] = field(default_factory=dict)  # (accepted, bonus) -> entry

    def fill(self, round_: int, entries: list[CacheEntry]) -> None:
        """Replace the entries with those pre-drafted for `round_`."""
        self.round = round_
        self.entries = {(e.accepted, e.bonus): e for e in entries}

    def take(self, round_: int, accepted: int, bonus: int) -> CacheEntry | None:
        """The entry for this outcome, if one was pre-drafted for this very round; the entries are spent either
        way (the next round needs new ones)."""
        entries, matches = self.entries, self.round == round_
        self.round, self.entries = -1, {}
        return entries.get((accepted, bonus)) if matches else None

    def outcomes(self, round_: int) -> list[tuple[int, int]]:
        """The outcomes pre-drafted for `round_`, best first ([] for another round)."""
        return list(self.entries) if self.round == round_ else []

    def __len__(self) -> int:
        return len(self.entries)
