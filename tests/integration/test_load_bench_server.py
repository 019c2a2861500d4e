"""`foresight bench --concurrency` end to end: a real `foresight serve` subprocess on the embedded default,
streaming clients at two levels, the report fields of docs/benchmark.md ("Load benchmark") and the chart."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from support.suite_dtype import resolved_suite_dtype, suite_dtype

pytestmark = pytest.mark.integration

LEVEL_FIELDS = {"requests", "ok", "rejected", "errors", "output_tokens", "wall_s", "tokens_per_s", "ttft_ms_p50",
                "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90", "tpot_ms_p50", "latency_ms_p50", "error_examples",
                "strategy_rounds", "compiled_rounds", "tokens_per_s_runs"}


def test_load_bench_report(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"},
        {"messages": [{"role": "user", "content": "Count from one to ten in words."}]},
    ]))
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "foresight.cli", "bench", "--prompts", str(prompts), "--modes", "ar",
           "--concurrency", "1,2", "--load-repeats", "2", "--max-tokens", "8", "--temperature", "0", "--dtype", suite_dtype(),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "load.server-ar.log").exists()
    assert (tmp_path / "load.server-ar-r2.log").exists()  # the second repeat's fresh server
    assert set(report) >= {"model", "drafter", "machine", "settings", "concurrency"}
    settings = report["settings"]
    assert settings["concurrency"] == [1, 2] and settings["modes"] == ["ar"]
    assert settings["requests_per_level"] == {"1": 2, "2": 4}  # max(2 x level, prompts)
    assert settings["repeats"] == 2
    assert set(report["concurrency"]) == {"1", "2"}
    assert report["ratios_vs_ar"] == {}  # no mode beside ar
    for level in ("1", "2"):
        fields = report["concurrency"][level]["ar"]
        assert set(fields) == LEVEL_FIELDS
        assert fields["requests"] == 2 * settings["requests_per_level"][level]  # both repeats pooled
        assert len(fields["tokens_per_s_runs"]) == 2 and all(x > 0 for x in fields["tokens_per_s_runs"])
        assert fields["ok"] == fields["requests"], fields["error_examples"]
        assert fields["rejected"] == 0 and fields["errors"] == 0
        assert fields["output_tokens"] > 0 and fields["tokens_per_s"] > 0
        assert set(fields["strategy_rounds"]) == {"ar"} and fields["strategy_rounds"]["ar"] > 0  # from /metrics
        # --compile auto compiles the int4 target (bf16): one client's rounds all run through graphs, two clients'
        # steps that carry a prompt chunk run eager
        if resolved_suite_dtype() == torch.bfloat16:
            assert 0.0 < fields["compiled_rounds"] <= 1.0 and (level == "2" or fields["compiled_rounds"] == 1.0)
        else:
            assert fields["compiled_rounds"] is None
        for key in ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90", "tpot_ms_p50"):
            assert fields[key] is not None and fields[key] >= 0, key
        assert fields["ttft_ms_p50"] <= fields["ttft_ms_p90"] and fields["itl_ms_p50"] <= fields["itl_ms_p90"]
