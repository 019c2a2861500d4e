"""`foresight bench` end to end on the embedded default: the report contract of docs/benchmark.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from support.suite_dtype import resolved_suite_dtype, suite_dtype

pytestmark = pytest.mark.integration

MODE_FIELDS = {"tokens_per_s", "output_tokens", "wall_s", "rounds", "tau", "hit_rate", "exposed_draft_ms_mean",
               "exposed_draft_ms_p50", "exposed_draft_ms_p90", "verify_ms_mean", "outputs_match_ar", "outputs_sha256",
               "verified_drafts_mean", "passes_mean", "refreshes_mean", "strategy_rounds", "tau_hits", "tau_misses",
               "compiled_rounds", "warmup_s"}
PROBE_FIELDS = {"mismatches", "mismatches_near_tie", "mismatches_unexplained", "mismatch_details"}
PIPELINE_FIELDS = {"pipeline_gain_ideal", "pipeline_efficiency"}  # pipelined, beside sync


def test_bench_report(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"},
        {"messages": [{"role": "user", "content": "Repeat after me: one two three one two three"}]},
    ]))
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "foresight.cli", "bench", "--prompts", str(prompts), "--modes", "ar,sync,pipelined,auto",
           "--max-tokens", "24", "--temperature", "0", "--nucleus-thresholds", "0.9", "--refinement-ablation", "none", "--peers", "hf",
           "--dtype", suite_dtype(), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert set(report) >= {"model", "drafter", "machine", "settings", "modes", "ratios", "nucleus", "refinement",
                           "peers"}
    assert set(report["modes"]) == {"ar", "sync", "pipelined", "auto"}
    assert report["drafter"] == "jetspec++"  # the shipped checkpoint, with its adapter
    assert report["settings"]["decoder_layers"] == 15  # the shipped adapter's recommendation, as resolved
    assert "decoder 15 layers" in report["settings"]["calibration"]  # the shipped fit, loaded beside the adapter
    assert set(report["modes"]["ar"]) == MODE_FIELDS
    for mode in ("sync", "pipelined", "auto"):
        extra = PIPELINE_FIELDS if mode == "pipelined" else set()
        assert set(report["modes"][mode]) == MODE_FIELDS | PROBE_FIELDS | extra
        assert_lossless(report["modes"][mode], n_prompts=2)
    pipelined, sync = report["modes"]["pipelined"], report["modes"]["sync"]
    ideal = (sync["exposed_draft_ms_mean"] + sync["verify_ms_mean"]) / sync["verify_ms_mean"]
    assert pipelined["pipeline_gain_ideal"] == pytest.approx(ideal)
    assert pipelined["pipeline_efficiency"] == pytest.approx((report["ratios"]["pipelined_vs_sync"] - 1) / (ideal - 1))
    for mode in ("ar", "sync", "pipelined", "auto"):
        assert report["modes"][mode]["output_tokens"] > 0 and report["modes"][mode]["warmup_s"] > 0
        assert sum(report["modes"][mode]["strategy_rounds"].values()) == report["modes"][mode]["rounds"]
    assert set(report["modes"]["ar"]["strategy_rounds"]) == {"ar"}
    assert set(report["modes"]["auto"]["strategy_rounds"]) <= {"ngram", "pipelined", "hybrid"}
    # A compiled target verifies every round of one request at a time through its graphs (ar: the 1-token one);
    # the drafter compiles its draft model's pass and context extension on a CPU (--drafter-compile auto)
    compiled = bool(report["machine"]["compiled"]["buckets"])
    assert report["modes"]["ar"]["compiled_rounds"] == (1.0 if compiled else None)
    assert report["machine"]["compiled_draft"]["draft_pass"] is True
    assert report["machine"]["compiled_draft"]["decoder_pass"] is True  # the shipped adapter: foresight's decoder
    assert report["machine"]["compiled_draft"]["adapter_pass"] is True  # and its adapter
    assert report["modes"]["ar"]["tau"] == 1.0 and report["modes"]["ar"]["exposed_draft_ms_mean"] is None
    assert report["modes"]["ar"]["verified_drafts_mean"] == 0.0 and report["modes"]["sync"]["passes_mean"] is None
    assert report["modes"]["sync"]["exposed_draft_ms_mean"] is not None
    assert 0.0 <= report["modes"]["pipelined"]["hit_rate"] <= 1.0 and report["modes"]["sync"]["hit_rate"] is None
    assert report["modes"]["sync"]["tau_hits"] is None and report["modes"]["sync"]["tau_misses"] is None
    assert any(report["modes"]["pipelined"][f] for f in ("tau_hits", "tau_misses"))
    assert all(report["ratios"][r] > 0 for r in ("sync_vs_ar", "pipelined_vs_sync", "pipelined_vs_ar", "auto_vs_ar"))
    assert report["ratios"]["auto_vs_best_of_ar_ngram"] == report["ratios"]["auto_vs_ar"]  # no ngram run here
    if resolved_suite_dtype() == torch.float32:
        assert report["refinement"]["none"]["outputs_match_ar"] == 1.0
        # every mode's outputs equal ar's, so their digests do too
        assert len({report["modes"][mode]["outputs_sha256"] for mode in report["modes"]}) == 1
    assert set(report["peers"]) == {"hf@2t", "hf@1t", "hf-pld@2t", "hf-pld@1t"}
    for peer in report["peers"].values():
        assert peer["tokens_per_s"] > 0 and set(peer["modes_vs_peer"]) == {"ar", "sync", "pipelined", "auto"}
        if resolved_suite_dtype() == torch.float32:
            assert peer["outputs_match_ar"] == 1.0  # transformers' greedy = ours, token for token
    nucleus = report["nucleus"]
    assert set(nucleus) == {"exact", "nucleus@0.9"}
    assert nucleus["exact"]["outputs_differ_from_exact"] == 0.0
    assert nucleus["exact"]["nucleus_extra_accepted_tokens"] == 0
    assert 0.0 <= nucleus["nucleus@0.9"]["outputs_differ_from_exact"] <= 1.0


def assert_lossless(fields: dict, n_prompts: int) -> None:
    """Greedy + exact verification is lossless: in fp32 every output equals ar's; in bf16 an output may
    differ only where the numerics probe finds the target's top-2 logits within rounding of each other."""
    assert fields["mismatches"] == round((1 - fields["outputs_match_ar"]) * n_prompts)
    assert fields["mismatches_unexplained"] == 0, fields["mismatch_details"]
    assert all(d["replay_faithful"] for d in fields["mismatch_details"]), fields["mismatch_details"]
    if resolved_suite_dtype() == torch.float32:
        assert fields["outputs_match_ar"] == 1.0 and fields["mismatches"] == 0
