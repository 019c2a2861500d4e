"""The load benchmark's pure parts (bench/load.py): statistics, SSE parsing, the server command, one request
against a mocked transport, the chart. No model, no server."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from foresight.bench import load
from foresight.bench.prompts import request_fields
from foresight.bench.load import RequestResult, percentile, summarise_level
from foresight.bench.report import write_load_chart
from foresight.config import ConfigError, EngineConfig, engine_from_args
from foresight.cli import build_parser


def ok(start, chunks, end, tokens):
    return RequestResult("ok", start=start, chunk_times=list(chunks), end=end, output_tokens=tokens)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile(list(range(11)), 50) == 5


def test_request_ttft_itl_tpot():
    r = ok(10.0, [10.2, 10.3, 10.6], 10.7, tokens=5)
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.1, 0.3])
    assert r.latency == pytest.approx(0.7)
    assert r.tpot == pytest.approx((0.7 - 0.2) / 4)
    assert ok(0.0, [0.5], 0.6, tokens=1).tpot is None  # one token: no time per output token
    assert RequestResult("error", start=1.0, end=2.0).ttft is None


def test_summarise_level_counts_and_rates():
    results = [
        ok(0.0, [0.1, 0.2, 0.4], 0.5, tokens=4),  # ITL 0.1, 0.2
        ok(0.0, [0.3, 0.6], 1.0, tokens=6),  # ITL 0.3
        RequestResult("rejected", start=0.0, end=0.01, error="HTTP 429: busy"),
        RequestResult("error", start=0.0, end=0.02, error="HTTP 500: boom"),
    ]
    s = summarise_level(results, wall_s=2.0)
    assert (s["requests"], s["ok"], s["rejected"], s["errors"]) == (4, 2, 1, 1)
    assert s["output_tokens"] == 10
    assert s["tokens_per_s"] == pytest.approx(5.0)  # answered requests' tokens over the level's wall time
    assert s["ttft_ms_p50"] == pytest.approx(200.0)  # TTFTs 100, 300
    assert s["ttft_ms_p90"] == pytest.approx(280.0)
    assert s["itl_ms_p50"] == pytest.approx(200.0)  # pooled ITLs 100, 200, 300
    assert s["itl_ms_p90"] == pytest.approx(280.0)
    assert s["tpot_ms_p50"] == pytest.approx(1e3 * ((0.5 - 0.1) / 3 + (1.0 - 0.3) / 5) / 2, abs=1e-3)  # ms, rounded
    assert s["error_examples"] == ["HTTP 429: busy", "HTTP 500: boom"]


def test_run_order_rotates_the_modes():
    modes = ["ar", "sync", "auto"]
    orders = [load.run_order(modes, r) for r in range(4)]
    assert orders == [["ar", "sync", "auto"], ["sync", "auto", "ar"], ["auto", "ar", "sync"], ["ar", "sync", "auto"]]
    assert all(sorted({o[i] for o in orders[:3]}) == sorted(modes) for i in range(3))  # each mode in each place


def test_merge_runs_median_rate_and_pooled_percentiles():
    fast = [ok(0.0, [0.1, 0.2], 0.3, tokens=10)]  # 10 tokens in 1 s
    slow = [ok(0.0, [0.4, 0.8], 1.0, tokens=10)]  # 10 tokens in 4 s
    mid = [ok(0.0, [0.2, 0.4], 0.5, tokens=10)]  # 10 tokens in 2 s
    fields = load.merge_runs([(fast, 1.0), (slow, 4.0), (mid, 2.0)])
    assert fields["tokens_per_s_runs"] == [10.0, 2.5, 5.0]
    assert fields["tokens_per_s"] == 5.0  # the median run, not the pooled 30 / 7
    assert fields["requests"] == 3 and fields["output_tokens"] == 30 and fields["wall_s"] == 7.0
    assert fields["ttft_ms_p50"] == pytest.approx(200.0)  # TTFTs 100, 400, 200 pooled
    failed = load.merge_runs([([RequestResult("error", error="boom")], 1.0)])
    assert failed["tokens_per_s"] is None and failed["tokens_per_s_runs"] == [None]


def test_ratios_vs_ar_pair_runs_of_one_repeat():
    section = {"8": {"ar": {"tokens_per_s_runs": [40.0, 50.0, 45.0]},
                     "sync": {"tokens_per_s_runs": [44.0, 45.0, None]},
                     "auto": {"tokens_per_s_runs": [40.0, 60.0, 45.0]}},
               "1": {"sync": {"tokens_per_s_runs": [20.0]}}}  # no ar at this level: no ratios
    ratios = load.ratios_vs_ar(section)
    assert set(ratios) == {"8"} and set(ratios["8"]) == {"sync", "auto"}
    assert ratios["8"]["sync"] == {"median": pytest.approx(1.0), "runs": [1.1, 0.9]}  # the failed run left out
    assert ratios["8"]["auto"] == {"median": 1.0, "runs": [1.0, 1.2, 1.0]}


def test_summarise_level_without_answers():
    s = summarise_level([RequestResult("rejected", error="HTTP 429: x")] * 3, wall_s=1.0)
    assert (s["ok"], s["rejected"], s["errors"], s["tokens_per_s"], s["ttft_ms_p50"]) == (0, 3, 0, None, None)


def test_parse_levels_and_requests_per_level():
    assert load.parse_levels("1, 4,8,16,4") == [1, 4, 8, 16]
    for bad in ("", "0", "two", "1,-2"):
        with pytest.raises(ConfigError):
            load.parse_levels(bad)
    assert load.requests_per_level(1, 20, None) == 20
    assert load.requests_per_level(16, 20, None) == 32
    assert load.requests_per_level(16, 20, 5) == 5


def test_parse_event():
    chat = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    assert load.parse_event(json.dumps(chat)) == ("Hi", None, None)
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    assert load.parse_event(json.dumps(role_only)) == ("", None, None)
    completion = {"choices": [{"index": 0, "text": " world", "finish_reason": None}]}
    assert load.parse_event(json.dumps(completion)) == (" world", None, None)
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}
    assert load.parse_event(json.dumps(usage)) == ("", 7, None)
    assert load.parse_event(json.dumps({"error": {"message": "worker died"}})) == ("", None, "worker died")


def test_request_body_chat_and_completion():
    args = argparse.Namespace(max_tokens=8, temperature=0.5, seed=3)
    path, body = load.request_body({"messages": [{"role": "user", "content": "x"}]}, 2, args)
    assert path == "/v1/chat/completions" and body["seed"] == 5 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8
    path, body = load.request_body({"prompt": "def f():"}, 0, args)
    assert path == "/v1/completions" and body["prompt"] == "def f():" and body["temperature"] == 0.5


def test_request_fields_go_with_every_request_and_are_checked():
    args = argparse.Namespace(max_tokens=8, temperature=0.5, seed=3, request_fields='{"presence_penalty": 0.5}')
    assert load.request_body({"prompt": "x"}, 0, args)[1]["presence_penalty"] == 0.5
    assert request_fields("") == {} and request_fields('{"min_tokens": 2}') == {"min_tokens": 2}
    for bad in ("{", "[1]", '{"prompt": "other"}'):
        with pytest.raises(SystemExit, match="--request-fields"):
            request_fields(bad)


def test_serve_argv_carries_the_engine_flags():
    cfg = EngineConfig(dtype="float32", target_threads=2, drafter="ngram", borrow_drafter_threads=False,
                       mode="sync", model_name="m")
    argv = load.serve_argv(cfg, "ar", 1234, ["--max-num-seqs", "4"])
    assert argv[1:4] == ["-m", "foresight.cli", "serve"]
    flags = argv[4:]
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--dtype"] == "float32" and pairs["--target-threads"] == "2" and pairs["--drafter"] == "ngram"
    assert pairs["--served-model-name"] == "m" and pairs["--max-num-seqs"] == "4"
    assert "--no-borrow-drafter-threads" in flags and "--batched-steps" in flags
    assert "--target" not in flags and "--decoder-layers" not in flags  # None: the server's own default
    assert flags.count("--mode") == 1 and flags[-6:] == ["--mode", "ar", "--host", "127.0.0.1", "--port", "1234"]
    # the flags parse back into the same engine config (mode aside)
    parsed = engine_from_args(build_parser().parse_args(["serve"] + flags))
    assert parsed.to_dict() == {**cfg.to_dict(), "mode": "ar"}


def sse_body(events: list) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def run_one(handler) -> RequestResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await load.one_request(client, "http://test", "/v1/completions", {"prompt": "x"}, {})
    return asyncio.run(go())


def test_one_request_streams_and_takes_tokens_from_usage():
    events = [{"choices": [{"text": ""}]}, {"choices": [{"text": "a"}]}, {"choices": [{"text": "bc"}]},
              {"choices": [], "usage": {"completion_tokens": 5}}, "[DONE]"]
    r = run_one(lambda request: httpx.Response(200, content=sse_body(events)))
    assert r.status == "ok" and r.output_tokens == 5 and len(r.chunk_times) == 2  # the empty first chunk is no content
    assert r.ttft is not None and r.ttft >= 0 and r.end >= r.chunk_times[-1]


def test_one_request_failures_are_counted_not_raised():
    r = run_one(lambda request: httpx.Response(429, json={"error": {"message": "the server is busy"}}))
    assert r.status == "rejected" and "429" in r.error
    r = run_one(lambda request: httpx.Response(503, json={"error": {"message": "not ready"}}))
    assert r.status == "error" and "503" in r.error
    r = run_one(lambda request: httpx.Response(200, content=sse_body([{"choices": [{"text": "a"}]},
                                                                       {"error": {"message": "boom"}}, "[DONE]"])))
    assert r.status == "error" and "boom" in r.error
    r = run_one(lambda request: httpx.Response(200, content=sse_body([{"choices": [{"text": "a"}]}])))
    assert r.status == "error" and "[DONE]" in r.error

    def refuse(request):
        raise httpx.ConnectError("refused")

    r = run_one(refuse)
    assert r.status == "error" and "ConnectError" in r.error


def test_run_level_sends_every_request_once():
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append(body["prompt"])
        return httpx.Response(200, content=sse_body([{"choices": [{"text": "t"}]},
                                                     {"choices": [], "usage": {"completion_tokens": 1}}, "[DONE]"]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            args = argparse.Namespace(max_tokens=4, temperature=0.0, seed=0)
            return await load.run_level(client, "http://test", [{"prompt": "p0"}, {"prompt": "p1"}], 3, 5, args, {})

    results, wall_s = asyncio.run(go())
    assert len(results) == 5 and all(r.status == "ok" for r in results) and wall_s >= 0
    assert sorted(seen) == ["p0", "p0", "p0", "p1", "p1"]  # prompts cycled


def test_load_chart(tmp_path):
    fields = {"tokens_per_s": 10.0, "itl_ms_p50": 30.0}
    report = {"model": "m", "drafter": "auto", "settings": {"temperature": 0.0, "max_tokens": 8, "n_prompts": 2},
              "concurrency": {"1": {"ar": fields, "sync": {**fields, "tokens_per_s": None}},
                              "4": {"ar": {**fields, "tokens_per_s": 25.0}, "sync": fields}}}
    path = tmp_path / "load.png"
    write_load_chart(report, path)
    assert path.stat().st_size > 1000
