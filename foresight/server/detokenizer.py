"""Incremental detokenization with stop strings, in the api process.

Each step decodes only a window of recent tokens, as vLLM's detokenizer does: `prefix` is the decoded
text of the tokens already turned into output (from `prefix_offset` to `read_offset`), `full` that of the
same tokens plus the new ones, and the new text is `full[len(prefix):]`. Decoding from the same start
token twice keeps what a tokenizer does at the start of a sequence (e.g. SentencePiece dropping a
leading space) out of the difference, and a multi-byte character split across tokens shows up as a
trailing U+FFFD until its last byte arrives. The work per step is O(window), not O(output).

Stop strings: text that could still become the start of a stop string is held back, so a stop string
is never streamed, even in part. With stop strings the tokens of a step are taken one at a time, so the output
ends with the token that completed the stop string (`kept`): the tokens a speculative step committed after it
are not part of the answer (nor of its usage or logprobs).
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: the tokens of the last output piece begin here
        self.read_offset = 0  # tokens before this are in the output
        self.pending = ""  # decoded, not yet sent: held back for stop strings
        self.sent_chars = 0
        self.stopped = False
        self.kept = 0  # of the tokens of the last `add`, those in the output (all of them unless a stop cut it)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text that is safe to send (held back: incomplete characters
        and anything that could still become a stop string)."""
        if self.stopped:
            self.kept = 0
            return ""
        self.kept = 0
        for piece in ([token_ids] if not self.stop or len(token_ids) <= 1 else [[t] for t in token_ids]):
            self.token_ids.extend(piece)
            self.kept += len(piece)
            self.pending += self._decode_new(final and self.kept == len(token_ids))
            self._cut_at_stop()
            if self.stopped:
                break
        keep = 0 if (final or self.stopped) else min(self.hold_back, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        self.sent_chars += len(out)
        return out

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past `read_offset`, or "" while it ends in an incomplete character."""
        window = self.token_ids[self.prefix_offset:]
        prefix = self._decode(window[: self.read_offset - self.prefix_offset])
        full = self._decode(window)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing new yet, or wait for the other bytes of a character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _cut_at_stop(self) -> None:
        # Held-back text plus the new piece is the only place a stop string can newly appear: one that
        # began in text already sent would have fit in the text of that step and been found then.
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending = self.pending[: min(hits)]
            self.stopped = True
