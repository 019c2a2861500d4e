"""eval-quality: the setting parser, NLL scoring on tiny random models, code extraction and the sandbox."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from foresight.bench import humaneval_check as hc
from foresight.bench.prompts import humaneval_problems
from foresight.bench import quality
from foresight.bench.harness import ModeTally, Run
from foresight.bench.quality import Setting, answers_nll, parse_settings
from foresight.config import ConfigError
from foresight import cli
from support.tiny_models import VOCAB, tiny_model

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


@torch.inference_mode()
def one_by_one_nll(model, prompt: list[int], answer: list[int]) -> float:
    """Reference: one unbatched, uncached forward over prompt + answer, log-softmax over every row."""
    if not answer:
        return 0.0
    logits = model(torch.tensor([prompt + answer])).logits[0]  # [seq, vocab]
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # rows that predict the answer tokens
    return -logp.gather(1, torch.tensor(answer)[:, None]).sum().item()


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "qwen3_5"])
def tiny(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("max_tokens", [2048, 40])  # one batch, and several (the prompt cache reused)
def test_batched_nll_matches_one_by_one(tiny, max_tokens):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (23,), generator=gen).tolist()
    answers = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 1, 0, 30, 5, 30)]
    answers.append(answers[3][:12] + [7])  # shares a prefix with another answer
    got = answers_nll(tiny, prompt, answers, max_tokens=max_tokens)
    want = [one_by_one_nll(tiny, prompt, a) for a in answers]
    assert got[2] == 0.0 and min(want[:2] + want[3:]) > 1.0
    assert got == pytest.approx(want, abs=1e-4, rel=0)


def test_batched_nll_with_a_one_token_prompt(tiny):
    answers = [[5, 6, 7], [8]]
    assert answers_nll(tiny, [3], answers) == pytest.approx([one_by_one_nll(tiny, [3], a) for a in answers],
                                                           abs=1e-4, rel=0)


def test_score_nll_sums_each_settings_answers(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(quality, "load_target", lambda *args: model)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4]]
    outputs = {"exact": [[10, 11, 12], [13, 14]], "nucleus@0.9": [[10, 11, 12], []]}
    answers = [quality.Answers(Run(key, "sync", "exact", 0.9), ModeTally()) for key in outputs]
    for a in answers:
        a.tally.outputs = outputs[a.run.label]
    quality.score_nll(answers, prompts, Path("unused"))
    for a in answers:
        want = sum(one_by_one_nll(model, p, o) for p, o in zip(prompts, outputs[a.run.label]))
        assert a.nll_sum == pytest.approx(want, abs=1e-4, rel=0)


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
