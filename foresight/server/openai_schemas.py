"""OpenAI-compatible request bodies, validated before any model work.

Every constraint names its parameter so a 400 says which field was wrong. Fields we do not
implement are rejected (not silently ignored) unless they are at their neutral value. Text that
reaches the tokenizer must be valid Unicode (JSON's "\\ud800" escapes decode to lone surrogates,
which no tokenizer can encode), and numbers must be finite (Python's json accepts NaN and Infinity).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

# Limits on what one request may hold (the body size is bounded separately, --max-request-bytes).
MAX_MESSAGES = 2048
MAX_STOP = 16  # OpenAI allows 4; each is searched for in every step's new text
MAX_STOP_CHARS = 256  # streamed text is held back by the longest stop string's length


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode at character {exc.start} (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


def _content_part_text(i: int, part: Any) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"content part {i} must be an object")
    if part.get("type") != "text":
        raise ValueError(f"content part {i}: only parts of type 'text' are supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"content part {i}: 'text' must be a string")
    return _valid_unicode(text)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Any = None  # a string, a list of text parts, or null; checked below for a clear message

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if v is None:
            return v
        if isinstance(v, str):
            return _valid_unicode(v)
        if isinstance(v, list):
            return [{"type": "text", "text": _content_part_text(i, p)} for i, p in enumerate(v)]
        raise ValueError("content must be a string, a list of text parts, or null")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**31)
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    logprobs: Any = None
    verification: Literal["exact", "nucleus"] | None = None
    nucleus_threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    user: Text | None = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "presence_penalty",
                     "frequency_penalty", "nucleus_threshold", mode="before")
    @classmethod
    def _not_a_boolean(cls, v):
        # JSON true/false would pass pydantic's lax int/float parsing as 1/0.
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | list[int] | list[Text]
    max_tokens: int | None = Field(default=16, gt=0)
    echo: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_are_integers(cls, v):
        if isinstance(v, list) and any(isinstance(t, bool) for t in v):
            raise ValueError("token ids must be integers, not booleans")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _max_tokens_alias(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_body(message: str, type_: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
