"""Token logprobs (protocol `TokenLogprobs`, computed by the target worker) in OpenAI's two response shapes.

chat:         choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
              "bytes"}]}], "refusal": None}
completions:  choice.logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
              "text_offset": [...]}; with echo the prompt's tokens come first, its first token with null values.

A token's text is its own decoding, special tokens included (`<|im_end|>`), as vLLM reports it; its bytes are the
exact bytes it stands for where the tokenizer is byte-level (a token holding part of a UTF-8 character decodes to
U+FFFD, its bytes stay the real ones), else the UTF-8 of its text. A logprob of -inf (a token a rule or top-k/top-p
removed, with --logprobs-mode processed) is reported as -9999.0: JSON has no infinity (vLLM does the same).
"""
from __future__ import annotations

from ..protocol.messages import TokenLogprobs

IMPOSSIBLE = -9999.0


def finite(value: float) -> float:
    return value if value > IMPOSSIBLE else IMPOSSIBLE


def _byte_level_map(tokenizer) -> dict[str, int] | None:
    """char -> byte of a byte-level BPE tokenizer's alphabet (GPT-2's), or None for another kind of tokenizer."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return None
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Each token's text and bytes, decoded once (a server sees a few thousand distinct tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_map = _byte_level_map(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        known = self._cache.get(token)
        if known is None:
            known = self._cache[token] = self._decode(token)
        return known

    def _decode(self, token: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if self.byte_map is not None:
            symbols = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(symbols, str) and all(c in self.byte_map for c in symbols):
                return text, [self.byte_map[c] for c in symbols]
        return text, list(text.encode("utf-8"))

    # ------------------------------------------------------------------ chat

    def chat_entries(self, token_ids: list[int], lp: TokenLogprobs) -> list[dict]:
        """OpenAI chat `logprobs.content` entries of `token_ids`."""
        return [{**self._entry(token, value), "top_logprobs": [self._entry(t, v) for t, v in zip(ids, values)]}
                for token, value, ids, values in zip(token_ids, lp.values, lp.top_ids, lp.top_values)]

    def _entry(self, token: int, value: float) -> dict:
        text, raw = self.of(token)
        return {"token": text, "logprob": finite(value), "bytes": raw}

    # ------------------------------------------------------------------ completions

    def completion_part(self, token_ids: list[int], lp: TokenLogprobs | None, offset: int,
                        first_unscored: bool = False) -> dict:
        """OpenAI completions `logprobs` lists of `token_ids`, whose text starts at character `offset` of the
        choice's text; `first_unscored`: the first token is a prompt's first and has no logprob (`lp` covers the
        others). Each position's `top_logprobs` holds the k most likely tokens and the token itself (OpenAI: "up
        to logprobs+1 elements")."""
        tokens, offsets = [], []
        for token in token_ids:
            text = self.of(token)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        values: list = [None] * first_unscored
        tops: list = [None] * first_unscored
        scored = token_ids[first_unscored:]
        for token, value, ids, top_values in zip(scored, lp.values, lp.top_ids, lp.top_values) if lp else ():
            values.append(finite(value))
            top = {self.of(t)[0]: finite(v) for t, v in zip(ids, top_values)}
            top.setdefault(self.of(token)[0], finite(value))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ChoiceLogprobs:
    """One choice's logprobs as its tokens arrive: each piece's in the route's shape, and the whole choice's."""

    def __init__(self, texts: TokenTexts, chat: bool):
        self.texts = texts
        self.chat = chat
        self.offset = 0  # completions: characters of the choice's text before the next token
        self.parts: list = []  # chat: entries; completions: lists per piece

    def add(self, token_ids: list[int], lp: TokenLogprobs | None, prompt: bool = False) -> dict | None:
        """The logprobs object of a piece of `token_ids` (scored by `lp`; `prompt`: completions' echoed prompt,
        whose first token has no logprob); None for a piece without tokens."""
        if not token_ids:
            return None
        if self.chat:
            entries = self.texts.chat_entries(token_ids, lp)
            self.parts += entries
            return {"content": entries, "refusal": None}
        part = self.texts.completion_part(token_ids, lp, self.offset, first_unscored=prompt)
        self.offset += sum(len(token) for token in part["tokens"])
        self.parts.append(part)
        return part

    def whole(self) -> dict:
        if self.chat:
            return {"content": self.parts, "refusal": None}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {key: [item for part in self.parts for item in part[key]] for key in keys}
