"""How a model writes tool calls: the grammar of its calls, the parser that reads them back, and whether its chat
template describes the tools itself (`--tool-call-parser`; `auto` picks by the template, as vLLM's parsers are
picked by hand).

- `json`, this server's own, for templates that know no tools (SmolLM2's): the tools are described in a system
  message (structured.tool_prompt); calls are a JSON list `[{"name": ..., "arguments": {...}}]`, after `<tool_call>`
  when tool_choice is auto; a named function's output is its arguments alone.
- `hermes` (templates that write `<tool_call>`: Qwen2.5 and Qwen3, Hermes, SmolLM3): the template describes the
  tools (`apply_chat_template(tools=...)`) and renders earlier calls and results; each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several one per line.
- `llama3_json` (Llama 3.1 to 3.3): the template describes the tools; a call is `{"name": ..., "parameters":
  {...}}`, several separated by "; ".

The grammar makes the model write exactly its format. With tool_choice auto an answer is text or calls from its
first character, so a text answer cannot begin with the calls' first character (`mark[0]`: "<" or "{").
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

log = logging.getLogger("foresight.api")

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ToolCalls = list[tuple[str, object]]  # (function name, its arguments as decoded JSON)


def parameters(tool: dict) -> dict:
    """A tool's arguments schema (an empty object when it declares none)."""
    return tool.get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: list[dict], args_key: str) -> dict:
    """One call of any of `tools`: {"name": <its name>, args_key: <its arguments>}."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, args_key: parameters(t)},
              "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A way of writing calls. `native`: the chat template describes the tools and renders calls given back;
    `mark`: what calls begin with; `open`/`close`: the text around each call's JSON (hermes' tags);
    `separator`: between calls; `args_key`: the key of a call's arguments."""

    name: str
    native: bool
    mark: str
    open: str = ""
    close: str = ""
    separator: str = ""
    args_key: str = "arguments"

    def calls_lark(self, tools: list[dict], parallel: bool, auto: bool) -> str:
        """A Lark grammar (llguidance's, %json inside) of calls of `tools` in this format: one or more
        (`parallel`) or exactly one; `auto`: or a text answer that does not begin with `mark[0]`."""
        body = json.dumps({**call_schema(tools, self.args_key), "x-guidance": JSON_STYLE})
        rules = ["start: TEXT | calls" if auto else "start: calls",
                 f"calls: call ({json.dumps(self.separator)} call)*" if parallel else "calls: call",
                 f"call: {json.dumps(self.open)} body {json.dumps(self.close)}" if self.open else "call: body",
                 f"body: %json {body}"]
        if auto:
            rules.append(f"TEXT: /[^{re.escape(self.mark[0])}][\\s\\S]*/")
        return "\n".join(rules)

    def parse(self, text: str) -> ToolCalls | None:
        """The calls `text` holds, whole (None: not calls, or cut short). Whitespace around the tags and between
        calls is not checked: the grammar wrote it."""
        calls, rest = [], text.strip()
        decoder = json.JSONDecoder()
        open_, close, separator = self.open.strip(), self.close.strip(), self.separator.strip()
        while rest:
            if not rest.startswith(open_):
                return None
            try:
                value, end = decoder.raw_decode(rest[len(open_):].lstrip())
            except ValueError:
                return None
            rest = rest[len(open_):].lstrip()[end:].lstrip()
            if not rest.startswith(close):
                return None
            rest = rest[len(close):].lstrip()
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) or self.args_key not in value:
                return None
            calls.append((value["name"], value[self.args_key]))
            if rest.startswith(separator):
                rest = rest[len(separator):].lstrip()
        return calls or None


# This server's own format is described and parsed in structured.py (its calls are a JSON list, its named
# output the arguments alone); the object only names it and its mark.
JSON_TOOLS = ToolFormat("json", native=False, mark="<tool_call>")
HERMES = ToolFormat("hermes", native=True, mark="<tool_call>", open="<tool_call>\n", close="\n</tool_call>",
                    separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", native=True, mark="{", separator="; ", args_key="parameters")
TOOL_FORMATS = {f.name: f for f in (JSON_TOOLS, HERMES, LLAMA3_JSON)}  # config.TOOL_PARSERS names them and auto


def template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text ("" without one)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def takes_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` it is given."""
    return re.search(r"\btools\b", template) is not None


def tool_format(tokenizer, parser: str = "auto") -> ToolFormat:
    """The format of `--tool-call-parser` `parser` for this tokenizer's template; `auto`: hermes where the template
    writes `<tool_call>`, llama3_json where it writes `<|python_tag|>` or asks for "parameters", else json. A
    native format named for a template that reads no tools is refused (ValueError)."""
    template = template_text(tokenizer)
    if parser != "auto":
        fmt = TOOL_FORMATS[parser]
        if fmt.native and not takes_tools(template):
            raise ValueError(f"tool_call_parser: {parser} needs a chat template that describes tools, and this "
                             f"model's template reads no `tools` (use auto or json)")
        return fmt
    if not takes_tools(template):
        return JSON_TOOLS
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3_JSON
    log.warning("the chat template reads tools in a format this server does not parse; tools are described in a "
                "system message and called in this server's own JSON format (--tool-call-parser json)")
    return JSON_TOOLS
