"""Chat messages -> the prompt's token ids, through the model's chat template, with message text kept as text.

The template's own control tokens (`<|im_start|>`, `<|im_end|>`) delimit the turns. A client's message that holds
the same characters must not become those tokens, or one message could close its turn and forge another (a
`system` turn inside a `user` message). So where any message holds the text of one of the tokenizer's added tokens,
the conversation is rendered with a placeholder in place of each message's content, the template's text around
them is tokenized as usual, and each content is tokenized with special tokens split into ordinary pieces (as
transformers' `split_special_tokens` does). A conversation without such text is tokenized whole, exactly as the
template gives it. `--allow-special-tokens-in-content` keeps the old behaviour for deployments that trust their
clients (e.g. to send a prompt that is already templated).
"""
from __future__ import annotations

import re

# Private-use characters: no tokenizer's special token and no template's syntax holds them.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


class ContentNotKept(ValueError):
    """The template did not keep each message's content once, in order, so it cannot be tokenized apart."""


def added_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's added tokens (control tokens and the like), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted({token.content for token in decoder.values() if token.content}, key=len, reverse=True)


def holds_control_text(text: str, controls: list[str]) -> bool:
    return any(c in text for c in controls)


def chat_prompt_ids(tokenizer, messages: list[dict], split_special: bool, controls: list[str],
                    tools: list[dict] | None = None) -> list[int]:
    """The prompt of `messages` ({"role", "content"} dicts) with the generation prompt after them. `split_special`:
    control-token text inside a message's content is tokenized as text. `tools`: given to a template that
    describes them itself (OpenAI tool objects)."""
    extra = {"tools": tools} if tools else {}
    if not split_special or not any(holds_control_text(m["content"], controls) for m in messages):
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra))
    return piecewise_ids(tokenizer, messages, extra)


def piecewise_ids(tokenizer, messages: list[dict], extra: dict | None = None) -> list[int]:
    """The template's text tokenized as usual and each message's content with special tokens split (a template
    that does not keep every content once, in order: ContentNotKept). `extra`: the template's other inputs."""
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **(extra or {}))
    pieces = _MARK_RE.split(rendered)  # [template text, content index, template text, ...]
    if [int(i) for i in pieces[1::2]] != list(range(len(messages))):
        raise ContentNotKept("the chat template does not keep each message's content once, in order")
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids += tokenizer.encode(messages[int(piece)]["content"], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
