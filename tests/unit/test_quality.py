"""eval-quality without a model: the setting parser, code extraction and the sandboxed HumanEval check."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from foresight.bench import humaneval_check as hc
from foresight.bench.prompts import humaneval_problems
from foresight.bench.quality import Setting, answer_nll, parse_settings
from foresight.config import ConfigError
from foresight.server import cli

CORRECT_BODY = """    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
"""


@pytest.fixture(scope="module")
def problem() -> dict:
    return humaneval_problems()[0]  # HumanEval/0, has_close_elements


# ------------------------------------------------------------------ settings

def test_settings_parse_dedupe_and_keep_order():
    settings = parse_settings("nucleus@0.90, exact,nucleus@0.8,nucleus@0.9,exact,nucleus@1")
    assert [s.key for s in settings] == ["nucleus@0.9", "exact", "nucleus@0.8", "nucleus@1"]
    assert settings[0] == Setting("nucleus", 0.9) and settings[1] == Setting("exact")


@pytest.mark.parametrize("bad", ["", "greedy", "nucleus", "nucleus@", "nucleus@0", "nucleus@1.5",
                                 "nucleus@-0.2", "nucleus@abc", "exact@0.9", "top_p@0.9"])
def test_bad_settings_name_the_flag(bad):
    with pytest.raises(ConfigError, match="--verification"):
        parse_settings(bad)


def test_cli_reports_a_bad_setting_in_one_line_before_loading_models(monkeypatch, capsys):
    def load(*args, **kwargs):
        raise AssertionError("the engine started before the settings were checked")

    monkeypatch.setattr("foresight.bench.harness.EngineClient", load)
    assert cli.main(["eval-quality", "--verification", "exact,nucleus@2", "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("foresight: error: --verification") and "\n" not in err


class PeekingLM:
    """Row j of the logits is sure of token j + 1 when `sure`, else uniform; honours logits_to_keep."""

    def __init__(self, vocab: int, sure: bool):
        self.vocab, self.sure = vocab, sure

    def __call__(self, ids: torch.Tensor, logits_to_keep: int) -> SimpleNamespace:
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        if self.sure:
            logits[0, torch.arange(ids.shape[1] - 1), ids[0, 1:]] = 50.0
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def test_answer_nll_scores_exactly_the_answer_tokens():
    prompt, answer = [1, 2, 3, 4], [5, 6, 7]
    assert answer_nll(PeekingLM(10, sure=True), prompt, answer) < 1e-6  # misaligned rows would cost ~50 each
    assert answer_nll(PeekingLM(10, sure=False), prompt, answer) == pytest.approx(3 * math.log(10), rel=1e-5)
    assert answer_nll(PeekingLM(10, sure=True), prompt, []) == 0.0


# ------------------------------------------------------------------ extraction

def test_fenced_answer_with_full_def_is_a_function(problem):
    answer = ("Here is the function:\n\n```python\nfrom typing import List\n\n"
              "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + CORRECT_BODY +
              "```\n\nIt compares every pair.")
    ext = hc.extract(problem, answer)
    assert ext.kind == "function" and "def has_close_elements" in ext.completion
    assert hc.check(problem, answer).passed


def test_unfenced_bare_body_continues_the_prompt(problem):
    ext = hc.extract(problem, CORRECT_BODY)
    assert ext.kind == "body" and ext.completion == CORRECT_BODY
    assert hc.check(problem, CORRECT_BODY).passed


def test_flush_left_body_in_a_fence_is_indented(problem):
    ext = hc.extract(problem, "```\nreturn any(abs(a - b) < threshold for i, a in enumerate(numbers)"
                              " for b in numbers[i + 1:])\n```")
    assert ext.kind == "body" and ext.completion.startswith("    return any(")


def test_answer_without_code_fails_without_running(problem):
    answer = "I am sorry, I cannot help with that request."
    assert hc.extract(problem, answer).kind == "none"
    assert hc.check(problem, answer) == hc.CheckResult(False, "failed: no code that parses")


def test_truncated_fence_still_yields_the_code(problem):
    answer = "```python\ndef has_close_elements(numbers, threshold):\n" + CORRECT_BODY  # max_tokens cut it
    assert hc.extract(problem, answer).kind == "function"
    assert hc.check(problem, answer).passed


def test_blocks_that_are_not_python_are_dropped(problem):
    answer = ("```python\ndef has_close_elements(numbers, threshold):\n" + CORRECT_BODY + "```\n"
              "Output:\n```\n>>> has_close_elements([1.0, 2.0], 0.5)\nFalse\n```")
    assert hc.extract(problem, answer).kind == "function"
    assert hc.check(problem, answer).passed


# ------------------------------------------------------------------ sandboxed execution

def test_canonical_program_passes(problem):
    assert hc.run_program(hc.program(problem, problem["canonical_solution"])) == hc.CheckResult(True, "passed")


def test_wrong_solution_fails(problem):
    result = hc.check(problem, "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    assert not result.passed and "AssertionError" in result.result


def test_endless_loop_times_out_and_is_killed(problem, tmp_path):
    marker = tmp_path / "alive"
    answer = ("```python\nimport time\ndef has_close_elements(numbers, threshold):\n"
              "    while True:\n        time.sleep(0.05)\n```")
    t0 = time.monotonic()
    assert hc.check(problem, answer, timeout_s=1.0) == hc.CheckResult(False, "timed out")
    assert time.monotonic() - t0 < 5.0
    # A child the program spawned into its session dies with it: nothing appends to the marker afterwards.
    source = (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
              f"\"import time\\nwhile True:\\n    open({str(marker)!r}, 'a').write('x'); time.sleep(0.05)\"])\n"
              f"while True:\n    pass\n")
    assert hc.run_program(source, timeout_s=1.0).result == "timed out"
    assert marker.exists()  # the child did run
    time.sleep(0.3)
    size = marker.stat().st_size
    time.sleep(0.5)
    assert marker.stat().st_size == size


def test_program_runs_in_an_empty_temporary_folder():
    assert hc.run_program("import os\nassert set(os.listdir('.')) == {'program.py', 'stderr.txt'}").passed


def test_network_is_isolated():
    if not hc.network_isolated():
        pytest.skip("`unshare --net` does not work on this machine: HumanEval programs run with network access")
    result = hc.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)\n")
    assert not result.passed and "unreachable" in result.result.lower()
