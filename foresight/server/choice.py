"""One choice of a response as its engine outputs (`Piece`s) arrive: its text, logprobs and finish reason, as
stream chunks or as one whole choice, in the chat or the completions shape. A choice that calls tools
(structured.py) holds its text back and ends with OpenAI's `tool_calls` (finish reason `tool_calls`); streamed,
the calls come as one delta once the text is complete."""
from __future__ import annotations

from ..protocol.messages import GenerateRequest
from .logprobs import ChoiceLogprobs
from .serving import Piece
from .structured import TOOL_MARK, Structure, tool_calls


class Choice:
    def __init__(self, index: int, request: GenerateRequest, chat: bool, structure: Structure,
                 logprobs: ChoiceLogprobs | None, echo: str | None):
        """`echo`: completions' echoed prompt text (None: no echo)."""
        self.index = index
        self.request = request
        self.chat = chat
        self.structure = structure
        self.logprobs = logprobs
        self.echo = echo
        self.last: Piece | None = None
        self.texts: list[str] = []
        self.reason: str | None = None
        self.calls: list[dict] | None = None  # a tool-calling choice's calls, once complete
        # Whether the output is calls: known at once for tool_choice required or named, at its first character
        # for auto (None until then), never without tools.
        self.calling: bool | None = None if structure.auto else structure.calls_tools

    def add(self, piece: Piece) -> list[tuple[str, str | None, dict | None]]:
        """(text, finish reason, logprobs) of what `piece` adds: completions' echoed prompt first (with its
        logprobs, which come with the first piece), then the piece's own."""
        parts = []
        if self.last is None and self.echo is not None:
            lp = self.logprobs.add(self.request.prompt_ids, piece.output.prompt_logprobs, prompt=True) \
                if self.logprobs is not None else None
            parts.append((self.echo, None, lp))
        lp = self.logprobs.add(piece.token_ids, piece.logprobs) \
            if self.logprobs is not None and self.request.sampling.logprobs is not None else None
        parts.append((piece.text, piece.reason, lp))
        self.last = piece
        self.texts += [text for text, _, _ in parts]
        self.reason = piece.reason or self.reason
        text = "".join(self.texts)
        if self.calling is None and text:
            self.calling = text.startswith(TOOL_MARK[0])
        if piece.reason is not None and self.calling:
            self.calls = tool_calls(text, self.structure)
        return parts

    def stream(self, piece: Piece) -> list[dict]:
        """The stream chunks' choice objects for `piece`."""
        chunks, first = [], self.last is None
        for text, reason, logprobs in self.add(piece):
            if self.calling is not False:  # calls, or not known yet: no text goes out
                chunks += self._tool_chunks(text, reason, logprobs, first)
            elif text or reason is not None or logprobs is not None or first:
                chunks.append(self._chunk(self._delta(text, first), reason, logprobs))
            first = False
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
        if not self.chat:
            return {"index": self.index, "text": text, "finish_reason": self.reason, "logprobs": logprobs}
        if self.calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": self.calls}
            return {"index": self.index, "message": message, "finish_reason": "tool_calls", "logprobs": logprobs}
        return {"index": self.index, "message": {"role": "assistant", "content": text}, "finish_reason": self.reason,
                "logprobs": logprobs}
