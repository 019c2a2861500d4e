"""OpenAI-compatible request bodies, validated before any model work.

Every constraint names its parameter so a 400 says which field was wrong. No field is silently ignored: the
fields of OpenAI's requests (and the vLLM extensions clients send) that we do not implement are accepted only at
the value that asks for nothing (`NEUTRAL_ONLY`), a few that never change the output are accepted as they are
(`user`, `metadata`, ...), and any other field is refused with a 400 naming it. Text that
reaches the tokenizer must be valid Unicode (JSON's "\\ud800" escapes decode to lone surrogates,
which no tokenizer can encode), and numbers must be finite (Python's json accepts NaN and Infinity).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

# Limits on what one request may hold (the body size is bounded separately, --max-request-bytes).
MAX_MESSAGES = 2048
MAX_STOP = 16  # OpenAI allows 4; each is searched for in every step's new text
MAX_STOP_CHARS = 256  # streamed text is held back by the longest stop string's length
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_N = 16  # choices per request: each runs as a request of its own in the engine
MAX_TOP_LOGPROBS = 20  # alternatives per position (chat's top_logprobs bound; completions' logprobs, as vLLM's)
TopCount = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode at character {exc.start} (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. vLLM's continuous_usage_stats: refused, not ignored
    include_usage: StrictBool = False


def _content_part_text(i: int, part: Any) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"content part {i} must be an object")
    if part.get("type") != "text":
        raise ValueError(f"content part {i}: only parts of type 'text' are supported")
    unknown = sorted(set(part) - {"type", "text"})
    if unknown:
        raise ValueError(f"content part {i}: {', '.join(unknown)} not supported (a text part has type and text)")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"content part {i}: 'text' must be a string")
    return _valid_unicode(text)


# The roles a message may have: OpenAI's. "developer" is OpenAI's newer name for "system", and is rendered as one;
# "tool" carries a tool call's result back (structured.py renders it).
ROLES = ("system", "developer", "user", "assistant", "tool")
# Message fields of OpenAI's that we do not build, and the values (what a client echoes back from an earlier
# answer of ours) that ask for nothing.
MESSAGE_NEUTRAL = {"name": (None,), "function_call": (None,), "refusal": (None,), "audio": (None,),
                   "annotations": (None, [])}


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text  # JSON text, as OpenAI returns it


class ToolCall(BaseModel):
    """A call of ours that the client sends back in the assistant message that made it."""

    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Text
    content: Any = None  # a string, a list of text parts, or null; checked below for a clear message
    name: Any = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call this result answers
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to an assistant message")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id")
        return self

    @field_validator(*MESSAGE_NEUTRAL, mode="before")
    @classmethod
    def _neutral(cls, v, info):
        return refuse_unless_neutral(v, info.field_name, MESSAGE_NEUTRAL)

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


# Fields we do not implement, and the values that ask for nothing (what the field means when absent): any other
# value is a 400 naming the field.
NEUTRAL_ONLY: dict[str, tuple] = {
    # both routes (vLLM's extensions)
    "min_p": (None, 0.0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    # chat (OpenAI)
    "functions": (None, []), "function_call": (None, "none"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
    "verbosity": (None,), "store": (None, False), "service_tier": (None, "auto", "default"),
    # chat (vLLM's extensions)
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    # completions (OpenAI)
    "best_of": (None, 1), "suffix": (None, ""),
}
# Chat's own (vLLM's): echo is a completions field, built there.
CHAT_NEUTRAL_ONLY = {"echo": (None, False)}


def is_neutral(value: Any, neutral: tuple) -> bool:
    """Is `value` one of `neutral` (1 is 1.0, but a JSON true is not a 1, nor false a 0)?"""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def refuse_unless_neutral(value: Any, field: str, neutral: dict[str, tuple] = NEUTRAL_ONLY) -> Any:
    """`value` of `field`, unless it asks for something (not one of `neutral[field]`): a ValueError then."""
    if not is_neutral(value, neutral[field]):
        shown = "".join(f" or {json.dumps(n)}" for n in neutral[field] if n is not None)
        raise ValueError(f"{field} is not supported by this server (accepted only absent{shown}, which asks for "
                         f"nothing)")
    return value


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # enforced either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # enforced either way


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**31)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # vLLM's
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(default=0, ge=0, lt=2**31)  # vLLM's
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)  # vLLM's
    # vLLM's: the prompt's and the answer's token ids beside the text (streamed: the prompt's in the first chunk,
    # each chunk's own new ids)
    return_token_ids: StrictBool | None = None
    min_p: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    verification: Literal["exact", "nucleus"] | None = None
    nucleus_threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    user: Text | None = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "nucleus_threshold", mode="before")
    @classmethod
    def _not_a_boolean(cls, v):
        # JSON true/false would pass pydantic's lax int/float parsing as 1/0.
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """{"token id": bias}: ids are decimal integers, biases in [-100, 100] (OpenAI's range)."""
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids (decimal integers), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must lie in [-100, 100], got {bias}")
        return v

    @field_validator("logit_bias", "stop_token_ids", mode="before")
    @classmethod
    def _no_booleans_inside(cls, v):
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else []
        if any(isinstance(item, bool) for item in items):
            raise ValueError("must hold numbers, not booleans")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if any(t < 0 for t in v or []):
            raise ValueError("token ids must be non-negative integers")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return v

    @field_validator(*NEUTRAL_ONLY, mode="before", check_fields=False)  # the routes declare their own ones
    @classmethod
    def _neutral(cls, v, info):
        return refuse_unless_neutral(v, info.field_name)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | list[int] | list[Text]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, score the prompt only
    logprobs: TopCount | None = None  # each token's logprob and its position's k most likely tokens'
    echo: StrictBool | None = None  # the prompt before the completion (with logprobs: the prompt's logprobs too)
    best_of: Any = None
    suffix: Any = None

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
        if isinstance(v, (str, list)) and (len(v) == 0 or v == [""]):
            raise ValueError("prompt must not be empty")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: StrictBool | None = None
    top_logprobs: TopCount | None = None  # needs logprobs: true
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    service_tier: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    echo: Any = None  # vLLM's
    parallel_tool_calls: StrictBool | None = None  # tool_choice required: false = exactly one call
    # Accepted as they come: they never change what is generated (ids for the provider's logs and caches).
    metadata: dict[str, Text] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None


    @field_validator(*CHAT_NEUTRAL_ONLY, mode="before")
    @classmethod
    def _chat_neutral(cls, v, info):
        return refuse_unless_neutral(v, info.field_name, CHAT_NEUTRAL_ONLY)

    @model_validator(mode="after")
    def _max_tokens_alias(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_body(message: str, type_: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
