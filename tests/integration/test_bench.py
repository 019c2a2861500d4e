"""`foresight bench` end to end on the embedded default: the report contract of docs/benchmark.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

MODE_FIELDS = {"tokens_per_s", "output_tokens", "wall_s", "rounds", "tau", "hit_rate", "exposed_draft_ms_mean",
               "exposed_draft_ms_p50", "exposed_draft_ms_p90", "verify_ms_mean", "outputs_match_ar",
               "verified_drafts_mean", "passes_mean", "refreshes_mean"}


def test_bench_report(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"},
        {"messages": [{"role": "user", "content": "Repeat after me: one two three one two three"}]},
    ]))
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "foresight.server.cli", "bench", "--prompts", str(prompts), "--modes", "ar,sync,pipelined",
           "--max-tokens", "24", "--temperature", "0", "--nucleus-thresholds", "0.9", "--refinement-ablation", "none",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert set(report) >= {"model", "drafter", "machine", "settings", "modes", "ratios", "nucleus", "refinement"}
    assert set(report["modes"]) == {"ar", "sync", "pipelined"}
    assert report["drafter"] == "jetspec++"  # the shipped checkpoint, with its adapter
    assert report["settings"]["decoder_layers"] == 15  # the shipped adapter's recommendation, as resolved
    for mode in ("ar", "sync", "pipelined"):
        assert set(report["modes"][mode]) == MODE_FIELDS
        assert report["modes"][mode]["outputs_match_ar"] == 1.0  # greedy + exact verification is lossless
        assert report["modes"][mode]["output_tokens"] > 0
    assert report["modes"]["ar"]["tau"] == 1.0 and report["modes"]["ar"]["exposed_draft_ms_mean"] is None
    assert report["modes"]["ar"]["verified_drafts_mean"] == 0.0 and report["modes"]["sync"]["passes_mean"] is None
    assert report["modes"]["sync"]["exposed_draft_ms_mean"] is not None
    assert 0.0 <= report["modes"]["pipelined"]["hit_rate"] <= 1.0 and report["modes"]["sync"]["hit_rate"] is None
    assert all(report["ratios"][r] > 0 for r in ("sync_vs_ar", "pipelined_vs_sync", "pipelined_vs_ar"))
    assert report["refinement"]["none"]["outputs_match_ar"] == 1.0
    nucleus = report["nucleus"]
    assert set(nucleus) == {"exact", "nucleus@0.9"}
    assert nucleus["exact"]["outputs_differ_from_exact"] == 0.0
    assert nucleus["exact"]["nucleus_extra_accepted_tokens"] == 0
    assert 0.0 <= nucleus["nucleus@0.9"]["outputs_differ_from_exact"] <= 1.0
