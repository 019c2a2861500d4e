"""One choice of a response as its engine outputs (`Piece`s) arrive: its text, logprobs and finish reason, as
stream chunks or as one whole choice, in the chat or the completions shape. A choice that calls tools
(structured.py) holds its text back and ends with OpenAI's `tool_calls` (finish reason `tool_calls`); streamed,
the calls come as one delta once the text is complete."""
from __future__ import annotations

from ..protocol.messages import GenerateRequest
from .logprobs import ChoiceLogprobs
from .serving import Piece
from .structured import Structure, tool_calls


class Choice:
    def __init__(self, index: int, request: GenerateRequest, chat: bool, structure: Structure,
                 logprobs: ChoiceLogprobs | None, echo: str | None, token_ids: bool = False):
        """`echo`: completions' echoed prompt text (None: no echo); `token_ids`: vLLM's return_token_ids (each
        chunk's new token ids, and a completions choice's prompt ids in its first chunk)."""
        self.index = index
        self.request = request
        self.chat = chat
        self.structure = structure
        self.logprobs = logprobs
        self.echo = echo
        self.with_ids = token_ids
        self.last: Piece | None = None
        self.texts: list[str] = []
        self.ids: list[int] = []  # the answer's token ids so far
        self.held: list[int] = []  # ids of parts no chunk went out for yet (a tool call held back)
        self.reason: str | None = None
        self.calls: list[dict] | None = None  # a tool-calling choice's calls, once complete
        # Whether the output is calls: known at once for tool_choice required or named, at its first character
        # for auto (None until then), never without tools.
        self.calling: bool | None = None if structure.auto else structure.calls_tools

    def add(self, piece: Piece) -> list[tuple[str, str | None, dict | None, list[int]]]:
        """(text, finish reason, logprobs, token ids) of what `piece` adds: completions' echoed prompt first (with
        its logprobs, which come with the first piece; its ids are the prompt's, not the answer's), then the
        piece's own."""
        parts = []
        if self.last is None and self.echo is not None:
            lp = self.logprobs.add(self.request.prompt_ids, piece.output.prompt_logprobs, prompt=True) \
                if self.logprobs is not None else None
            parts.append((self.echo, None, lp, []))
        lp = self.logprobs.add(piece.token_ids, piece.logprobs) \
            if self.logprobs is not None and self.request.sampling.logprobs is not None else None
        parts.append((piece.text, piece.reason, lp, piece.token_ids))
        self.last = piece
        self.texts += [text for text, _, _, _ in parts]
        self.ids += piece.token_ids
        self.reason = piece.reason or self.reason
        text = "".join(self.texts)
        if self.calling is None and text:
            self.calling = text.startswith(self.structure.format.mark[0])
        if piece.reason is not None and self.calling:
            self.calls = tool_calls(text, self.structure)
        return parts

    def stream(self, piece: Piece) -> list[dict]:
        """The stream chunks' choice objects for `piece`."""
        chunks, first = [], self.last is None
        for text, reason, logprobs, ids in self.add(piece):
            if self.calling is not False:  # calls, or not known yet: no text goes out
                new = self._tool_chunks(text, reason, logprobs, first)
            elif text or reason is not None or logprobs is not None or first or (ids and self.with_ids):
                new = [self._chunk(self._delta(text, first), reason, logprobs)]
            else:
                new = []
            chunks += self._with_ids(new, ids, first)
            first = False
        return chunks

    def _with_ids(self, chunks: list[dict], ids: list[int], first: bool) -> list[dict]:
        """return_token_ids: the ids on the first of `chunks` (a held-back tool call carries them on the next
        chunk that goes out), a completions choice's prompt ids on its first chunk."""
        if not self.with_ids:
            return chunks
        self.held += ids
        if not chunks:
            return chunks
        chunks[0] = {**chunks[0], "token_ids": self.held}
        self.held = []
        if first and not self.chat:
            chunks[0]["prompt_token_ids"] = list(self.request.prompt_ids)
        return chunks

    def _tool_chunks(self, text: str, reason: str | None, logprobs: dict | None, first: bool) -> list[dict]:
        """A tool-calling choice streams no text: its role first, the calls when they are complete."""
        delta = {"role": "assistant", "content": None} if first else {}
        if reason is None:
            return [self._chunk(delta, None, logprobs)] if delta or logprobs is not None else []
        if self.calls is None:  # cut short (length), or an empty answer: the text as it is
            return [self._chunk({**delta, "content": "".join(self.texts)}, reason, logprobs)]
        calls = [{"index": j, **call} for j, call in enumerate(self.calls)]
        return [self._chunk({**delta, "tool_calls": calls}, "tool_calls", logprobs)]

    def _delta(self, text: str | None, first: bool) -> dict:
        if first:
            return {"role": "assistant", "content": text or ""}
        return {"content": text} if text else {}

    def _chunk(self, delta: dict, reason: str | None, logprobs: dict | None) -> dict:
        if self.chat:
            return {"index": self.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return {"index": self.index, "text": delta.get("content") or "", "finish_reason": reason,
                "logprobs": logprobs}

    def whole(self) -> dict:
        text = "".join(self.texts)
        logprobs = self.logprobs.whole() if self.logprobs is not None else None
        ids = {"token_ids": list(self.ids)} if self.with_ids else {}
        if not self.chat:
            prompt = {"prompt_token_ids": list(self.request.prompt_ids)} if self.with_ids else {}
            return {"index": self.index, "text": text, "finish_reason": self.reason, "logprobs": logprobs,
                    **prompt, **ids}
        if self.calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": self.calls}
            return {"index": self.index, "message": message, "finish_reason": "tool_calls", "logprobs": logprobs,
                    **ids}
        return {"index": self.index, "message": {"role": "assistant", "content": text}, "finish_reason": self.reason,
                "logprobs": logprobs, **ids}
