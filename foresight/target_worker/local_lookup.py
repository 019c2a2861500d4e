"""Strategy "ngram": prompt lookup run by the target itself, between its own steps.

Prompt lookup needs no model, only the request's tokens, which the target holds; asking the drafter
for it would cost a round trip per round (about 1 ms here, 2-4 % of a CPU step) for a lookup of well
under a millisecond. The verify-length controller (the drafter's, `verify_length.py`) decides how many
of the found drafts a round verifies, from the target's own verify costs and the lookup's acceptance;
when drafts stop paying it sends none, so a round is then a plain step plus a lookup.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..spec.ngram import lookup
from ..spec.sampling import drafts_before_banned
from ..control.verify_length import VerifyLengthController


class LocalLookup:
    """One per target worker: acceptance and verify costs are pooled over requests, as in the drafter."""

    def __init__(self, cfg: EngineConfig):
        self.n_max, self.n_min = cfg.ngram_max, cfg.ngram_min
        self.lengths = None if cfg.verify_length == "max" else \
            VerifyLengthController(allow_skip=cfg.verify_length == "auto")

    def propose(self, tokens: list[int], max_drafts: int, round_: int,
                banned: frozenset[int] = frozenset()) -> list[int]:
        """The drafts to verify after `tokens` (prompt + output; the last one is the anchor) in request round
        `round_`, at most `max_drafts`, ending before any token in `banned` (the request's logit bias bans it)."""
        if self.lengths is not None:
            max_drafts = self.lengths.draft_length(max_drafts, round_)
        drafts = lookup(tokens, max_drafts, self.n_max, self.n_min)
        drafts = drafts[:drafts_before_banned(drafts, banned)]
        if self.lengths is None or not drafts:
            return drafts
        return drafts[: self.lengths.choose(len(drafts), [], round_)]

    def observe(self, sent: int, accepted: int, verify_s: float) -> None:
        """A plain or lookup round verified `sent` drafts, accepted `accepted`, in `verify_s` seconds."""
        if self.lengths is not None:
            self.lengths.observe(sent, accepted, verify_s)
