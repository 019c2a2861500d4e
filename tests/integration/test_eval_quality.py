"""`foresight eval-quality` end to end on the embedded default: the report contract of docs/benchmark.md."""
from __future__ import annotations

import json

import pytest

from foresight.cli import main

pytestmark = pytest.mark.integration

RESULT_FIELDS = {"verification", "theta", "n_problems", "pass_at_1", "tokens_per_s", "tau",
                 "nucleus_extra_accepted_tokens", "nll_mean", "output_tokens", "outputs_differ_from_exact"}


def test_eval_quality_report(tmp_path):
    out = tmp_path / "quality.json"
    assert main(["eval-quality", "--prompts", "humaneval", "--limit", "2", "--max-tokens", "48",
                 "--verification", "exact,nucleus@0.9", "--dtype", "float32", "--drafter", "ngram",
                 "--temperature", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert set(report) == {"model", "drafter", "machine", "settings", "results", "problems"}
    settings = report["settings"]
    assert settings["n_prompts"] == 2 and settings["mode"] == "sync" and settings["max_tokens"] == 48
    assert settings["dtype"] == "float32" and isinstance(settings["network_isolated"], bool)
    assert list(report["results"]) == ["exact", "nucleus@0.9"]
    for key, r in report["results"].items():
        assert set(r) == RESULT_FIELDS
        assert r["n_problems"] == 2 and 0 < r["output_tokens"] <= 2 * 48
        assert 0.0 <= r["pass_at_1"] <= 1.0
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["nll_mean"] > 0
        assert 0.0 <= r["outputs_differ_from_exact"] <= 1.0
    assert report["results"]["exact"]["nucleus_extra_accepted_tokens"] == 0
    assert report["results"]["exact"]["outputs_differ_from_exact"] == 0.0
    assert report["results"]["nucleus@0.9"]["theta"] == 0.9
    assert [p["task_id"] for p in report["problems"]] == ["HumanEval/0", "HumanEval/1"]
