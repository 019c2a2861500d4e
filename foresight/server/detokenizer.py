"""Incremental detokenization with stop strings, in the api process.

Decoding the whole output each time and diffing is simple and exact (multi-byte characters split
across tokens come out right once complete); with the Rust tokenizers it costs well under a
millisecond for outputs of a few thousand tokens.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, cut at a stop string if one was found
        self.sent = 0  # characters of `text` already returned
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text that is safe to send (held back: incomplete characters
        and anything that could still become a stop string)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not final and text.endswith(REPLACEMENT_CHAR):
            text = text[: len(text) - 1]  # an incomplete multi-byte character: wait for its other bytes
        self.text = text
        self._cut_at_stop()
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold_back)
        new, self.sent = self.text[self.sent:end], end
        return new

    def _cut_at_stop(self) -> None:
        # Search only where a stop string could newly appear: it must end after what was sent.
        start = max(0, self.sent - self.hold_back)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
