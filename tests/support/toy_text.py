"""A byte-level stand-in for a tokenizer that fits the tiny models' vocabulary (ids 3..92, 1 = turn marker)."""
from __future__ import annotations


def toy_encode_text(text: str) -> list[int]:
    return [3 + b % 90 for b in text.encode()]


def toy_encode(messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """A chat conversation as [1, role and content bytes] per turn, then 1 for a generation prompt."""
    ids = []
    for m in messages:
        ids += [1] + toy_encode_text(m["role"] + "\n" + m["content"])
    return ids + ([1] if generation_prompt else [])


def toy_decode(ids: list[int]) -> str:
    """Any token sequence as readable text (a made-up word per token) ending like a sentence, so that it
    passes the chat requests' cleaning."""
    return " ".join(f"w{t}" for t in ids) + "."
