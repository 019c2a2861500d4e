"""The bench's pipeline efficiency (`modes.pipelined.pipeline_gain_ideal`, `.pipeline_efficiency`): the share of
a perfect pipeline's gain over sync that pipelined obtained, and the chart's title that reports it."""
from __future__ import annotations

import pytest

from foresight.bench.harness import pipeline_efficiency
from foresight.bench.report import _pipeline_note


def summary(pipelined_tps: float) -> dict:
    # sync: 10 ms of exposed drafting per 40 ms verify -> a perfect pipeline runs 1.25x sync
    return {"sync": {"tokens_per_s": 100.0, "exposed_draft_ms_mean": 10.0, "verify_ms_mean": 40.0},
            "pipelined": {"tokens_per_s": pipelined_tps, "tau_hits": 2.5, "tau_misses": 1.5}}


@pytest.mark.parametrize("pipelined_tps, efficiency", [(125.0, 1.0), (106.25, 0.25), (100.0, 0.0), (90.0, -0.4)])
def test_efficiency_is_the_share_of_the_ideal_gain_obtained(pipelined_tps, efficiency):
    got = pipeline_efficiency(summary(pipelined_tps))
    assert got["pipeline_gain_ideal"] == pytest.approx(1.25)
    assert got["pipeline_efficiency"] == pytest.approx(efficiency)


def test_without_a_sync_run_there_is_nothing_to_compare():
    report = summary(110.0)
    del report["sync"]
    assert pipeline_efficiency(report) == {"pipeline_gain_ideal": None, "pipeline_efficiency": None}
    no_drafting = summary(110.0)
    no_drafting["sync"]["exposed_draft_ms_mean"] = 0.0  # nothing to hide: no ideal gain to share
    assert pipeline_efficiency(no_drafting)["pipeline_efficiency"] is None


def test_the_chart_title_names_efficiency_and_tau_on_hits_and_misses():
    pipelined = summary(106.25)["pipelined"] | pipeline_efficiency(summary(106.25))
    note = _pipeline_note(pipelined)
    assert "25% of the ideal gain 1.25x over sync" in note and "tau hit / miss 2.50 / 1.50" in note
    assert _pipeline_note({}) == ""
