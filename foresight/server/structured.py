"""Structured output: `response_format` and `tools` / `tool_choice` -> the grammar the target applies at every
verified position (target_worker/grammar.py), and a choice's text -> OpenAI's `tool_calls`.

The grammar engine is llguidance (chosen over xgrammar by measurement, docs/status.md "Structured output": both mask
SmolLM2's vocabulary in well under 0.1 ms a token, and llguidance installs without dependencies where xgrammar
pulls triton). JSON is generated compact (", " and ": " between items, no other whitespace), so a small model
cannot wander into whitespace.

- `response_format` `json_object`: any JSON object; `json_schema`: that schema (`strict` or not, it is enforced).
- `tools` with `tool_choice` `required`: a JSON array of one or more calls `{"name": ..., "arguments": {...}}` of
  the tools (one call, not an array, with `parallel_tool_calls: false`); a named function: that function's
  arguments alone; `auto` (OpenAI's default when tools are given): a text answer, or `<tool_call>` and the calls
  (a text answer then cannot start with "<": that character begins calls); `none`: the tools are neither described
  nor called.
- The tools are described to the model in a system message (`tool_prompt`); calls sent back in an assistant
  message are rendered as the JSON list this server generates, and a `tool` message's result as its content.

That is this server's own format, for chat templates that know no tools. A template that does (Qwen's hermes
tags, Llama 3's JSON) gets the tools and the calls given back itself, and the grammar makes the model write its
own format (tool_formats.py, `--tool-call-parser`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .tool_formats import JSON_STYLE, JSON_TOOLS, ToolFormat, call_schema, parameters

# tool_choice auto: an answer that starts with this is calls; a text answer cannot start with "<".
TOOL_MARK = JSON_TOOLS.mark
ANY_OBJECT = {"type": "object"}


class StructureError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Structure:
    """What a request's output must be."""

    grammar: str | None = None  # llguidance grammar (None: free text)
    tools: tuple[dict, ...] = ()  # the functions the output calls (OpenAI `function` objects); () = no calls
    named: str | None = None  # tool_choice names this function (json format: the output is its arguments alone)
    parallel: bool = True  # tool_choice required / auto: an array of calls (else one call)
    auto: bool = False  # tool_choice auto: a text answer, or the format's mark and the calls
    format: ToolFormat = JSON_TOOLS  # how the calls are written (tool_formats.py)

    @property
    def calls_tools(self) -> bool:
        """The output is calls, whatever it says (tool_choice required or a named function)."""
        return bool(self.tools) and not self.auto


def structure_of(body, fmt: ToolFormat = JSON_TOOLS) -> Structure:
    """The structure a chat or completions body asks for, tool calls written in `fmt` (StructureError naming the
    field if it cannot be)."""
    response = getattr(body, "response_format", None)
    schema = None
    if response is not None and response.type == "json_object":
        schema = ANY_OBJECT
    elif response is not None and response.type == "json_schema":
        schema = response.json_schema.schema_ if response.json_schema.schema_ is not None else ANY_OBJECT
    tools = _tool_structure(body, fmt)
    if schema is not None and tools.calls_tools:
        raise StructureError("response_format and a tool call cannot both shape one answer", "response_format")
    if schema is not None:
        return Structure(grammar=compiled(schema, "response_format"))
    return tools


def tools_of(body) -> tuple[list[dict], object]:
    """The body's tools (OpenAI `function` objects as dicts) and its tool_choice."""
    return [t.function.model_dump(exclude_none=True) for t in getattr(body, "tools", None) or []], \
        getattr(body, "tool_choice", None)


def _tool_structure(body, fmt: ToolFormat) -> Structure:
    tools, choice = tools_of(body)
    if not tools:
        if choice not in (None, "none"):
            raise StructureError("tool_choice needs tools", "tool_choice")
        return Structure()
    if choice == "none":
        return Structure()
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    if fmt.native:
        return _native_structure(tools, choice, parallel, fmt)
    if choice in (None, "auto"):  # OpenAI's default with tools
        lark = f"start: TEXT | {json.dumps(TOOL_MARK)} calls\nTEXT: /[^<][\\s\\S]*/\ncalls: %json " + \
            json.dumps({**calls_schema(tools, parallel), "x-guidance": JSON_STYLE})
        return Structure(grammar=compiled_lark(lark, "tools"), tools=tuple(tools), parallel=parallel, auto=True)
    if choice == "required":
        return Structure(grammar=compiled(calls_schema(tools, parallel), "tools"), tools=tuple(tools), parallel=parallel)
    named = _named(tools, choice)
    return Structure(grammar=compiled(parameters(named[0]), "tools"), tools=tuple(named), named=named[0]["name"])


def _named(tools: list[dict], choice) -> list[dict]:
    named = [t for t in tools if t["name"] == choice.function.name]
    if not named:
        raise StructureError(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    return named


def _native_structure(tools: list[dict], choice, parallel: bool, fmt: ToolFormat) -> Structure:
    """Calls in the model's own format: auto (text or calls), required (calls), a named function (one call of
    it, in the same wrapping as any other call)."""
    auto = choice in (None, "auto")
    named = None if auto or choice == "required" else _named(tools, choice)
    callable_ = named or tools
    parallel = parallel and named is None
    grammar = compiled_lark(fmt.calls_lark(callable_, parallel, auto), "tools")
    return Structure(grammar=grammar, tools=tuple(callable_), named=named[0]["name"] if named else None,
                     parallel=parallel, auto=auto, format=fmt)


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of calls of `tools`: an array of one or more (`parallel`), else one call."""
    call = call_schema(tools, "arguments")
    return {"type": "array", "items": call, "minItems": 1} if parallel else call


def compiled(schema: dict, param: str) -> str:
    """The llguidance grammar of a JSON schema, validated (StructureError naming `param` if the engine cannot
    compile it)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except Exception as exc:  # whatever the engine makes of a client's schema, it is the client's to fix
        raise StructureError(f"{param}: the schema cannot be compiled: {exc}"[:600], param) from None
    return validated(grammar, param)


def compiled_lark(lark: str, param: str) -> str:
    """The llguidance grammar of a Lark grammar (with %json schemas inside), validated as `compiled` does."""
    import llguidance

    return validated(llguidance.LLMatcher.grammar_from_lark(lark), param)


def validated(grammar: str, param: str) -> str:
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:
        raise StructureError(f"{param}: the schema cannot be compiled: {exc}"[:600], param) from None
    if error:
        raise StructureError(f"{param}: the schema cannot be compiled: {error.strip()[:500]}", param)
    return grammar


def tool_prompt(tools: tuple[dict, ...], named: str | None, auto: bool = False) -> str:
    """A system message describing the tools to the model (`auto`: it may answer in text instead)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if named is not None:
        return f"Call the function {named}. Answer with its arguments as one JSON object.\nFunction:\n{listed}"
    calls = "a JSON list of calls, each {\"name\": ..., \"arguments\": {...}}"
    if auto:
        return (f"You can call functions. To call, answer with {TOOL_MARK} followed by {calls}; otherwise answer "
                f"in text.\nFunctions:\n{listed}")
    return f"You can call functions. Answer with {calls}.\nFunctions:\n{listed}"


def template_input(body, fmt: ToolFormat) -> tuple[list[dict], list[dict] | None]:
    """A chat body's messages as the template gets them, and the tools to give the template itself (None: the
    format describes them in a system message, or the request calls none)."""
    if not fmt.native:
        return with_tool_prompt([rendered_message(m) for m in body.messages], body), None
    names = {c.id: c.function.name for m in body.messages for c in m.tool_calls or ()}
    tools, choice = tools_of(body)
    messages = [native_message(m, names) for m in body.messages]
    return messages, [{"type": "function", "function": t} for t in tools] if tools and choice != "none" else None


def rendered_message(message) -> dict:
    """A chat message as the template gets it ({"role", "content"}): an assistant message that called tools carries
    its calls as the JSON list this server generates them in, a tool message its result as its content."""
    role = "system" if message.role == "developer" else message.role
    text = message.text()
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _json_or_text(c.function.arguments)} for c in message.tool_calls]
        text = f"{text}\n{json.dumps(calls, ensure_ascii=False)}" if text else json.dumps(calls, ensure_ascii=False)
    return {"role": role, "content": text}


def native_message(message, names: dict[str, str]) -> dict:
    """A chat message for a template that knows tools: an assistant's calls as `tool_calls` (arguments decoded,
    as templates write them with `tojson`), a tool result with the id and the name of the call it answers."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
        if message.tool_call_id in names:
            out["name"] = names[message.tool_call_id]
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def with_tool_prompt(messages: list[dict], body) -> list[dict]:
    """`messages` with the tools described in the system message, when the request may call them."""
    tools, choice = tools_of(body)
    if not tools or choice == "none":
        return messages
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    note = tool_prompt(tuple(t for t in tools if named in (None, t["name"])), named, auto=choice in (None, "auto"))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def tool_calls(text: str, structure: Structure) -> list[dict] | None:
    """OpenAI `tool_calls` of a finished choice's text (None: the text is not a complete call, e.g. cut short, or
    with tool_choice auto an answer in text)."""
    if structure.format.native:
        found = structure.format.parse(text) if text.startswith(structure.format.mark) else None
        return _openai_calls(found) if found else None
    if structure.auto:
        if not text.startswith(TOOL_MARK):
            return None
        text = text[len(TOOL_MARK):]
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if structure.named is not None:
        calls = [{"name": structure.named, "arguments": value}]
    else:
        calls = value if structure.parallel else [value]
    return _openai_calls([(c["name"], c["arguments"]) for c in calls])


def _openai_calls(calls: list[tuple[str, object]]) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls]
