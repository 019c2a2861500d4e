"""How a request runs: its mode, the strategy of each round, and the self-refinement of pre-drafted blocks.

StrEnums, so they are their plain strings everywhere a string is written: on the wire (msgpack packs a
StrEnum as its value), in `str()`, f-strings, JSON reports and Prometheus labels, and they compare and
hash equal to those strings. A value is parsed into its enum once, where it enters: `EngineConfig` (the
CLI), and a message's construction, which decoding runs too (`messages.py`).
"""
from __future__ import annotations

import enum


class _Kind(enum.StrEnum):
    @classmethod
    def parse(cls, value: object, name: str, error: type[ValueError] = ValueError):
        """`value` as a member of this enum, else `error` naming the parameter `name` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise error(f"{name} must be one of {', '.join(cls.values())} (got {value!r})") from None

    @classmethod
    def parse_optional(cls, value: object, name: str):
        """`parse`, with None kept (None: the server's default)."""
        return None if value is None else cls.parse(value, name)

    @classmethod
    def values(cls) -> list[str]:
        """The plain strings, in definition order (CLI choices, error messages)."""
        return [member.value for member in cls]


class Strategy(_Kind):
    """How one round of a request is run."""

    AR = "ar"  # a plain step, no drafts
    SYNC = "sync"  # the drafter's own proposer after each outcome (draft model, or prompt lookup)
    PIPELINED = "pipelined"  # the draft model with foresight while the target verifies
    NGRAM = "ngram"  # prompt lookup, run by the target
    HYBRID = "hybrid"  # prompt lookup on a long match, else the draft model


# Strategies the target runs without the drafter. Mode auto leaves "ar" out: "ngram" with its verify-length
# controller is a plain step whenever lookup finds nothing worth verifying, so ar can only lose to it by the
# lookup itself (well under a millisecond), and two near-equal rivals would cost exploring without end.
LOCAL_STRATEGIES = (Strategy.AR, Strategy.NGRAM)


# A request's mode: one strategy for every round, or `auto` (every round, the strategy with the best measured
# goodput). Made from `Strategy`, so that a new strategy is a mode without another edit.
Mode = _Kind("Mode", [(s.name, s.value) for s in Strategy] + [("AUTO", "auto")])


class Refinement(_Kind):
    """Self-refinement of pre-drafted blocks (pipelined, JetSpec++ section 4.3)."""

    NONE = "none"  # Jacobi passes only
    REFRESH = "refresh"  # + context refresh
    ANCHOR = "anchor"  # + anchor replacement
