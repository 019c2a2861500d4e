"""Prometheus metrics of the api process (the only process with a registry).

Every metric carries the prefix `foresight_` and the label `model_name` (listed in docs/deploy.md); the workers report
their numbers to the api (`RoundStats` inside `TokenOutput`) and the api records them here.

Label children that are known in advance (model, finish reasons, workers) are created at start so every
series exists, at zero, from the first scrape: `rate()` then sees the first increase, and the dashboard's
ratios have a denominator before any traffic.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foresight.control.load_policy import POLICIES as LOAD_POLICIES
from foresight.protocol.kinds import Strategy
from foresight.protocol.messages import ControllerStats, RoundStats

PREFIX = "foresight_"
FINISH_REASONS = ("stop", "length", "abort")
FAILURE_REASONS = ("bad_request", "queue_full", "worker_error")
WORKERS = ("target", "drafter")
FORWARDS = ("compiled", "eager")  # how a round's verification forward ran

# Seconds, from sub-millisecond GPU steps to minute-long CPU requests.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# Per-round timings: a ready block costs ~0 exposed latency, so start finer.
ROUND_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005) + LATENCY_BUCKETS
ACCEPT_LENGTH_BUCKETS = tuple(range(1, 34))  # committed tokens per round: accepted drafts + 1
SMALL_INT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


class ServerMetrics:
    """The api's metrics; call the `record_*` methods, serve `render()` at GET /metrics."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_draft_tokens: int = 0) -> None:
        """`max_draft_tokens` (gamma = block_size - 1) pre-creates the per-position acceptance series at 0,
        so their first acceptances show in rate(); pass it (positions otherwise appear with the first draft).
        """
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        m = model_name

        def counter(name, doc, *labels):
            return Counter(PREFIX + name, doc, ("model_name",) + labels, registry=self.registry)

        def gauge(name, doc, *labels):
            return Gauge(PREFIX + name, doc, ("model_name",) + labels, registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets, registry=self.registry)

        # requests
        self.requests_running = gauge("requests_running", "Requests the target is generating for.").labels(m)
        self.requests_waiting = gauge("requests_waiting", "Requests queued in the api.").labels(m)
        self.kv_tokens_reserved = gauge("kv_tokens_reserved",
                                        "KV-cache tokens the running requests reserve (prompt + max_tokens each)."
                                        ).labels(m)
        self.kv_tokens_budget = gauge("kv_tokens_budget", "The KV-cache token budget (--max-kv-tokens); 0 = none."
                                      ).labels(m)
        self._success = counter("request_success_total", "Finished requests.", "finished_reason")
        self._failure = counter("request_failure_total", "Failed or rejected requests.", "reason")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens prefilled.").labels(m)
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.").labels(m)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens.", LATENCY_BUCKETS).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.", LATENCY_BUCKETS).labels(m)
        # speculative decoding
        self.num_drafts = counter("spec_decode_num_drafts_total", "Rounds that verified draft tokens.").labels(m)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens_total", "Draft tokens verified.").labels(m)
        self.num_accepted = counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.").labels(m)
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos_total",
                                         "Draft tokens accepted at each block position.", "position")
        self.accept_length = histogram("accept_length", "Tokens committed per verification round.",
                                       ACCEPT_LENGTH_BUCKETS).labels(m)
        self.cache_lookups = counter("speculation_cache_lookups_total", "Speculation cache lookups.").labels(m)
        self.cache_hits = counter("speculation_cache_hits_total", "Speculation cache hits.").labels(m)
        self.exposed_draft = histogram("exposed_draft_latency_seconds", "Time the target waited for a block.",
                                       ROUND_LATENCY_BUCKETS).labels(m)
        self.verify = histogram("verify_latency_seconds", "Target verification time per round.",
                                ROUND_LATENCY_BUCKETS).labels(m)
        self.passes = histogram("draft_refinement_passes", "Drafter refinement passes (J) per block.",
                                SMALL_INT_BUCKETS).labels(m)
        self.refreshes = histogram("draft_context_refreshes", "Drafter context refreshes (R) per block.",
                                   SMALL_INT_BUCKETS).labels(m)
        self.nucleus_extra = counter("nucleus_extra_accepted_tokens_total",
                                     "Acceptances only the nucleus gate allowed.").labels(m)
        self._strategy_rounds = counter("strategy_rounds_total",
                                        "Verification rounds by strategy (mode auto's choices among them).",
                                        "strategy")
        self._rounds_by_forward = counter("rounds_by_forward_total",
                                          "Verification rounds by how the target's forward ran: a compiled graph "
                                          "or eager (only with compiled steps).", "forward")
        # the target's round planner (ControllerStats)
        self._auto_goodput = gauge("auto_goodput_tokens_per_second",
                                   "Mode auto's estimate of each strategy's goodput, pooled over a request class "
                                   "(greedy or sampled).", "request_class", "strategy")
        self._auto_exploring = gauge("auto_exploring_share",
                                     "Share of a request class's time mode auto's trials of rival strategies cost.",
                                     "request_class")
        self._load_policy = gauge("load_policy", "1 for the load policy the target runs now (draft, lookup, plain).",
                                  "policy")
        self.load_level = gauge("load_level", "The load level the load policy counts for (about the running "
                                "requests: 2, 4, 8, 16; 0: a lone request, no policy).").labels(m)
        self._policy_goodput = gauge("load_policy_goodput_tokens_per_second",
                                     "The load policy's estimate of each policy's throughput, by load level.",
                                     "load_level", "policy")
        # workers
        self._worker_up = gauge("worker_up", "1 while the worker is alive and ready.", "worker")
        self._worker_restarts = counter("worker_restarts_total", "Worker restarts by the supervisor.", "worker")

        for reason in FINISH_REASONS:
            self._success.labels(m, reason)
        for reason in FAILURE_REASONS:
            self._failure.labels(m, reason)
        for worker in WORKERS:
            self._worker_up.labels(m, worker)
            self._worker_restarts.labels(m, worker)
        for pos in range(max_draft_tokens):
            self._accepted_per_pos.labels(m, str(pos))
        for strategy in Strategy:
            self._strategy_rounds.labels(m, strategy)
        for forward in FORWARDS:
            self._rounds_by_forward.labels(m, forward)
        for policy in LOAD_POLICIES:
            self._load_policy.labels(m, policy)

    # ------------------------------------------------------------ requests

    def set_queue(self, running: int, waiting: int) -> None:
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)

    def set_kv_tokens(self, reserved: int, budget: int | None) -> None:
        """Reserved KV tokens and the budget (None: no budget, exported as 0)."""
        self.kv_tokens_reserved.set(reserved)
        self.kv_tokens_budget.set(budget or 0)

    def record_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def record_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e_seconds)

    def record_failure(self, reason: str) -> None:
        self._failure.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------ rounds

    def record_round(self, stats: RoundStats) -> None:
        """One verification round: spec-decode counters, committed length, drafter and target timings."""
        if stats.drafted > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(stats.drafted)
            self.num_accepted.inc(stats.accepted)
            for pos in range(stats.drafted):  # create every drafted position, so rate() sees its first hit
                child = self._accepted_per_pos.labels(self.model_name, str(pos))
                if pos < stats.accepted:
                    child.inc()
            self.passes.observe(stats.passes)
            self.refreshes.observe(stats.refreshes)
        self.accept_length.observe(stats.accepted + 1)  # accepted drafts + the bonus token
        if stats.cache_hit is not None:
            self.cache_lookups.inc()
            if stats.cache_hit:
                self.cache_hits.inc()
        if stats.exposed_draft_s is not None:
            self.exposed_draft.observe(stats.exposed_draft_s)
        self.verify.observe(stats.verify_s)
        self._strategy_rounds.labels(self.model_name, stats.strategy).inc()
        if stats.nucleus_extra:
            self.nucleus_extra.inc(stats.nucleus_extra)
        if stats.compiled is not None:
            self._rounds_by_forward.labels(self.model_name, FORWARDS[0] if stats.compiled else FORWARDS[1]).inc()

    def record_controllers(self, stats: ControllerStats) -> None:
        """The target's round planner's current figures."""
        m = self.model_name
        for key, rate in stats.auto_goodput.items():
            request_class, strategy = key.split("/", 1)
            self._auto_goodput.labels(m, request_class, strategy).set(rate)
        for request_class, share in stats.auto_exploring.items():
            self._auto_exploring.labels(m, request_class).set(share)
        for policy in LOAD_POLICIES:
            self._load_policy.labels(m, policy).set(1 if policy == stats.policy else 0)
        self.load_level.set(stats.load_level)
        for key, rate in stats.policy_goodput.items():
            level, policy = key.split("/", 1)
            self._policy_goodput.labels(m, level, policy).set(rate)

    # ------------------------------------------------------------ workers

    def set_worker_up(self, worker: str, up: bool) -> None:
        self._worker_up.labels(self.model_name, worker).set(1 if up else 0)

    def record_worker_restart(self, worker: str) -> None:
        self._worker_restarts.labels(self.model_name, worker).inc()

    # ------------------------------------------------------------ exposition

    def render(self) -> tuple[bytes, str]:
        """The body and content type for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
