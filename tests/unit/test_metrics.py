"""ServerMetrics: RoundStats move the right counters; every metric name documented in docs/deploy.md is rendered."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from foresight.protocol.messages import ControllerStats, RoundStats
from foresight.server.metrics import ServerMetrics

MODEL = "tiny-model"

# the metric names documented in docs/deploy.md, without the prefix
DOCUMENTED_METRICS = [
    "requests_running", "requests_waiting", "kv_tokens_reserved", "kv_tokens_budget", "request_success_total",
    "prompt_tokens_total",
    "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total", "accept_length",
    "speculation_cache_lookups_total", "speculation_cache_hits_total", "exposed_draft_latency_seconds",
    "verify_latency_seconds", "draft_refinement_passes", "draft_context_refreshes",
    "nucleus_extra_accepted_tokens_total", "strategy_rounds_total", "rounds_by_forward_total", "load_policy",
    "load_level", "worker_up", "worker_restarts_total",
]
# documented too, with series only once the target reports its round planner's figures (ControllerStats)
CONTROLLER_METRICS = ["auto_goodput_tokens_per_second", "auto_exploring_share", "load_policy_goodput_tokens_per_second"]


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: ServerMetrics, name: str, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    return samples(metrics)[("foresight_" + name, frozenset(labels.items()))]


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(MODEL)


def test_render_has_every_design_metric_from_the_start(metrics):
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in DOCUMENTED_METRICS:
        assert f"# TYPE foresight_{name} " in text, name
    names = {name for name, _ in samples(metrics)}
    for name in DOCUMENTED_METRICS:
        if name == "spec_decode_num_accepted_tokens_per_pos_total":
            continue  # positions appear with the first acceptance (or with max_draft_tokens)
        assert any(n.startswith("foresight_" + name) for n in names), name
    for labels in samples(metrics).keys():
        assert ("model_name", MODEL) in labels[1]


def test_label_children_exist_before_traffic(metrics):
    for reason in ("stop", "length", "abort"):
        assert value(metrics, "request_success_total", finished_reason=reason) == 0
    for worker in ("target", "drafter"):
        assert value(metrics, "worker_up", worker=worker) == 0
        assert value(metrics, "worker_restarts_total", worker=worker) == 0
    assert value(metrics, "accept_length_count") == 0
    for strategy in ("ar", "ngram", "sync", "pipelined", "hybrid"):
        assert value(metrics, "strategy_rounds_total", strategy=strategy) == 0
    for forward in ("compiled", "eager"):
        assert value(metrics, "rounds_by_forward_total", forward=forward) == 0


def test_positions_precreated_when_gamma_known():
    m = ServerMetrics(MODEL, max_draft_tokens=3)
    for pos in range(3):
        assert value(m, "spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == 0


def test_spec_round_moves_counters(metrics):
    metrics.record_round(RoundStats(drafted=5, accepted=3, nucleus_extra=1, verify_s=0.02,
                                    exposed_draft_s=0.001, cache_hit=True, passes=2, refreshes=1))
    metrics.record_round(RoundStats(drafted=5, accepted=1, nucleus_extra=0, verify_s=0.03,
                                    exposed_draft_s=0.0, cache_hit=False, passes=1, refreshes=0))
    assert value(metrics, "spec_decode_num_drafts_total") == 2
    assert value(metrics, "spec_decode_num_draft_tokens_total") == 10
    assert value(metrics, "spec_decode_num_accepted_tokens_total") == 4
    assert value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="3") == 0  # drafted, rejected
    assert ("foresight_spec_decode_num_accepted_tokens_per_pos_total",
            frozenset({"model_name": MODEL, "position": "5"}.items())) not in samples(metrics)
    assert value(metrics, "accept_length_count") == 2
    assert value(metrics, "accept_length_sum") == 4 + 2
    assert value(metrics, "accept_length_bucket", le="2.0") == 1
    assert value(metrics, "speculation_cache_lookups_total") == 2
    assert value(metrics, "speculation_cache_hits_total") == 1
    assert value(metrics, "exposed_draft_latency_seconds_count") == 2
    assert value(metrics, "verify_latency_seconds_count") == 2
    assert value(metrics, "verify_latency_seconds_sum") == pytest.approx(0.05)
    assert value(metrics, "draft_refinement_passes_sum") == 3
    assert value(metrics, "draft_context_refreshes_sum") == 1
    assert value(metrics, "draft_context_refreshes_bucket", le="0.0") == 1
    assert value(metrics, "nucleus_extra_accepted_tokens_total") == 1
    assert value(metrics, "strategy_rounds_total", strategy="ar") == 2  # RoundStats' default


def test_rounds_are_counted_by_strategy(metrics):
    for strategy in ("hybrid", "hybrid", "ngram"):
        metrics.record_round(RoundStats(drafted=1, accepted=1, nucleus_extra=0, verify_s=0.02, exposed_draft_s=None,
                                        cache_hit=None, strategy=strategy))
    assert value(metrics, "strategy_rounds_total", strategy="hybrid") == 2
    assert value(metrics, "strategy_rounds_total", strategy="ngram") == 1
    assert value(metrics, "strategy_rounds_total", strategy="sync") == 0


def test_rounds_are_counted_by_forward_only_with_compiled_steps(metrics):
    for compiled in (True, True, False, None):  # None: a target without compiled steps
        metrics.record_round(RoundStats(drafted=0, accepted=0, nucleus_extra=0, verify_s=0.01, exposed_draft_s=None,
                                        cache_hit=None, compiled=compiled))
    assert value(metrics, "rounds_by_forward_total", forward="compiled") == 2
    assert value(metrics, "rounds_by_forward_total", forward="eager") == 1
    assert value(metrics, "strategy_rounds_total", strategy="ar") == 4


def test_the_round_planners_figures_become_gauges(metrics):
    assert value(metrics, "load_policy", policy="draft") == 0 and value(metrics, "load_level") == 0
    metrics.record_controllers(ControllerStats(
        auto_goodput={"greedy/ngram": 80.0, "greedy/pipelined": 55.5}, auto_exploring={"greedy": 0.02},
        policy="lookup", load_level=4, policy_goodput={"4/lookup": 120.0, "2/draft": 90.0}))
    assert value(metrics, "auto_goodput_tokens_per_second", request_class="greedy", strategy="pipelined") == 55.5
    assert value(metrics, "auto_exploring_share", request_class="greedy") == 0.02
    assert [value(metrics, "load_policy", policy=p) for p in ("draft", "lookup", "plain")] == [0, 1, 0]
    assert value(metrics, "load_level") == 4
    assert value(metrics, "load_policy_goodput_tokens_per_second", load_level="2", policy="draft") == 90.0
    metrics.record_controllers(ControllerStats(policy="plain"))  # figures not sent again keep their last value
    assert [value(metrics, "load_policy", policy=p) for p in ("draft", "lookup", "plain")] == [0, 0, 1]
    assert value(metrics, "auto_goodput_tokens_per_second", request_class="greedy", strategy="ngram") == 80.0
    names = {family.name for family in text_string_to_metric_families(metrics.render()[0].decode())}
    assert {"foresight_" + name for name in CONTROLLER_METRICS} <= names


def test_ar_round_counts_only_length_and_verify(metrics):
    metrics.record_round(RoundStats(drafted=0, accepted=0, nucleus_extra=0, verify_s=0.05,
                                    exposed_draft_s=None, cache_hit=None))
    assert value(metrics, "spec_decode_num_drafts_total") == 0
    assert value(metrics, "spec_decode_num_draft_tokens_total") == 0
    assert value(metrics, "accept_length_count") == 1
    assert value(metrics, "accept_length_bucket", le="1.0") == 1
    assert value(metrics, "speculation_cache_lookups_total") == 0
    assert value(metrics, "exposed_draft_latency_seconds_count") == 0
    assert value(metrics, "verify_latency_seconds_count") == 1
    assert value(metrics, "draft_refinement_passes_count") == 0


def test_request_lifecycle_and_workers(metrics):
    metrics.set_queue(running=3, waiting=2)
    metrics.record_prompt_tokens(17)
    metrics.record_first_token(0.12)
    metrics.record_inter_token(0.03)
    metrics.record_inter_token(0.04)
    metrics.record_generation_tokens(9)
    metrics.record_finished("length", 1.5)
    metrics.record_failure("queue_full")
    metrics.set_worker_up("target", True)
    metrics.record_worker_restart("drafter")
    assert value(metrics, "requests_running") == 3
    assert value(metrics, "requests_waiting") == 2
    metrics.set_kv_tokens(reserved=120, budget=None)
    assert (value(metrics, "kv_tokens_reserved"), value(metrics, "kv_tokens_budget")) == (120, 0)
    metrics.set_kv_tokens(reserved=0, budget=4096)
    assert (value(metrics, "kv_tokens_reserved"), value(metrics, "kv_tokens_budget")) == (0, 4096)
    assert value(metrics, "prompt_tokens_total") == 17
    assert value(metrics, "generation_tokens_total") == 9
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "inter_token_latency_seconds_count") == 2
    assert value(metrics, "e2e_request_latency_seconds_sum") == 1.5
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    assert value(metrics, "request_success_total", finished_reason="stop") == 0
    assert value(metrics, "request_failure_total", reason="queue_full") == 1
    assert value(metrics, "worker_up", worker="target") == 1
    assert value(metrics, "worker_up", worker="drafter") == 0
    assert value(metrics, "worker_restarts_total", worker="drafter") == 1


def test_instances_have_separate_registries():
    a, b = ServerMetrics(MODEL), ServerMetrics(MODEL)
    a.record_generation_tokens(5)
    assert value(a, "generation_tokens_total") == 5
    assert value(b, "generation_tokens_total") == 0
