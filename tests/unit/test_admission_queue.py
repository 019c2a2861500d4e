"""Admission by memory in the real EngineClient, without workers: sequence slots (--max-num-seqs), the KV token
budget (--max-kv-tokens), first come first served, release on every exit path, 400 / 429 before any stream."""
from __future__ import annotations

import asyncio
import json
import shutil
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from foresight.config import ConfigError, EngineConfig, ServerConfig, engine_from_args, server_from_args
from foresight.protocol.messages import (AbortRequest, GenerateRequest, RequestFailed, SamplingParams,
                                         TokenOutput)
from foresight.server.engine_client import EngineClient, KVBudgetExceeded, QueueFull, RequestError
from foresight.server.metrics import ServerMetrics
from support.fake_engine import MODEL, ByteTokenizer, RecordingSocket, call

UP = "up"


def make_engine(max_model_len: int | None = None, **kwargs) -> EngineClient:
    """A real EngineClient whose target is 'up' and whose messages go to a RecordingSocket."""
    engine = EngineClient(EngineConfig(), metrics=ServerMetrics(MODEL), **kwargs)
    engine.send_to_target.socket.close(linger=0)
    engine.send_to_target = RecordingSocket()
    engine.supervisor.workers["target"].state = UP
    engine._reader = asyncio.ensure_future(asyncio.Event().wait())  # stands for the reader of worker messages
    engine.target_info = lambda: {} if max_model_len is None else {"max_model_len": max_model_len}
    return engine


def close(engine: EngineClient) -> None:
    engine._reader.cancel()
    engine.ctx.destroy(linger=0)
    shutil.rmtree(Path(engine.addrs.api_to_target.removeprefix("ipc://")).parent, ignore_errors=True)


@asynccontextmanager
async def engine_of(**kwargs):
    engine = make_engine(**kwargs)
    try:
        yield engine
    finally:
        close(engine)


def req(rid: str, prompt: int = 10, max_tokens: int = 10) -> GenerateRequest:
    return GenerateRequest(req_id=rid, prompt_ids=[1] * prompt, max_tokens=max_tokens, sampling=SamplingParams())


def started(engine) -> list[str]:
    return [m.req_id for m in engine.send_to_target.sent if isinstance(m, GenerateRequest)]


def aborted(engine) -> list[str]:
    return [m.req_id for m in engine.send_to_target.sent if isinstance(m, AbortRequest)]


def finish(engine, rid: str) -> None:
    engine._on_tokens(TokenOutput(req_id=rid, token_ids=[5], finished=True, finish_reason="length"))


async def until(condition, what: str = "the condition") -> None:
    """Let the loop run until `condition()` holds (a bound on loop turns, not on time)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never became true")


async def consume(engine, request) -> list[TokenOutput]:
    return [out async for out in engine.generate(request)]


async def submit(engine, request, running: int | None = None, waiting: int | None = None) -> asyncio.Task:
    """Start a client of `request`, wait until the engine counts it (running or waiting)."""
    before = engine.in_flight
    task = asyncio.ensure_future(consume(engine, request))
    await until(lambda: engine.in_flight == before + 1 or task.done(), f"{request.req_id} admitted or queued")
    if running is not None:
        assert engine.running == running
    if waiting is not None:
        assert engine.waiting == waiting
    return task


def gauge(engine, name: str) -> float:
    text = engine.metrics.render()[0].decode()
    line = next(line for line in text.splitlines() if line.startswith(f"foresight_{name}{{"))
    return float(line.split()[-1])


# ------------------------------------------------------------------ slots, budget, order


def test_requests_start_in_arrival_order_as_slots_free_up():
    async def go():
        async with engine_of(max_num_seqs=1, max_waiting=8) as engine:
            tasks = [await submit(engine, req(rid)) for rid in "abcd"]
            assert (engine.running, engine.waiting) == (1, 3) and started(engine) == ["a"]
            for i, rid in enumerate("abcd"):
                await until(lambda: started(engine) == list("abcd"[:i + 1]), f"{rid} started")
                finish(engine, rid)
                await tasks[i]
            assert started(engine) == list("abcd")
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


def test_a_request_waits_for_kv_budget_and_runs_when_another_finishes():
    async def go():
        async with engine_of(max_num_seqs=8, max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", prompt=10, max_tokens=50), running=1, waiting=0)
            b = await submit(engine, req("b", prompt=10, max_tokens=40), running=1, waiting=1)
            assert engine.kv_reserved == 60 and started(engine) == ["a"]  # 60 + 50 > 100: b waits
            assert gauge(engine, "kv_tokens_reserved") == 60 and gauge(engine, "kv_tokens_budget") == 100
            finish(engine, "a")
            await a
            await until(lambda: started(engine) == ["a", "b"], "b started")
            assert (engine.running, engine.waiting, engine.kv_reserved) == (1, 0, 50)
            assert gauge(engine, "kv_tokens_reserved") == 50
            finish(engine, "b")
            await b
            assert (engine.in_flight, engine.kv_reserved) == (0, 0) and gauge(engine, "kv_tokens_reserved") == 0
    asyncio.run(go())


def test_first_come_first_served_a_small_request_does_not_overtake_a_waiting_large_one():
    async def go():
        async with engine_of(max_num_seqs=8, max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", max_tokens=50))  # 60
            b = await submit(engine, req("b", max_tokens=40))  # 50: waits
            c = await submit(engine, req("c", prompt=5, max_tokens=5))  # 10 would fit beside a, but b is first
            assert started(engine) == ["a"] and engine.waiting == 2
            finish(engine, "a")
            await until(lambda: started(engine) == ["a", "b", "c"], "b then c started")
            assert engine.kv_reserved == 60
            for rid in "bc":
                finish(engine, rid)
            await asyncio.gather(a, b, c)
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


def test_reservation_is_capped_at_the_context_length():
    async def go():
        async with engine_of(max_model_len=64, max_kv_tokens=64) as engine:
            assert engine.reservation(req("a", prompt=10, max_tokens=100)) == 64
            task = await submit(engine, req("a", prompt=10, max_tokens=100), running=1)
            assert engine.kv_reserved == 64
            finish(engine, "a")
            await task
    asyncio.run(go())


def test_without_a_budget_only_slots_bound_admission():
    async def go():
        async with engine_of(max_num_seqs=2) as engine:
            tasks = [await submit(engine, req(rid, max_tokens=10_000)) for rid in "abc"]
            assert (engine.running, engine.waiting, engine.kv_reserved) == (2, 1, 2 * 10_010)
            assert gauge(engine, "kv_tokens_budget") == 0  # no budget
            for rid in "abc":
                await until(lambda: rid in started(engine), f"{rid} started")
                finish(engine, rid)
            await asyncio.gather(*tasks)
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


# ------------------------------------------------------------------ every exit path releases


def test_a_failed_request_releases_its_reservation():
    async def go():
        async with engine_of(max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", max_tokens=50))
            b = await submit(engine, req("b", max_tokens=40), waiting=1)
            engine._on_failed(RequestFailed(req_id="a", error="out of memory", status=500))
            with pytest.raises(RequestError):
                await a
            await until(lambda: started(engine) == ["a", "b"], "b started")
            assert engine.kv_reserved == 50
            finish(engine, "b")
            await b
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


def test_a_client_that_leaves_while_running_releases_and_aborts():
    async def go():
        async with engine_of(max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", max_tokens=50))
            b = await submit(engine, req("b", max_tokens=40), waiting=1)
            a.cancel()  # what the api does when the client disconnects or the time is up
            await asyncio.wait({a})
            assert aborted(engine) == ["a"]
            await until(lambda: started(engine) == ["a", "b"], "b started")
            assert engine.kv_reserved == 50
            finish(engine, "b")
            await b
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


def test_a_client_that_leaves_while_waiting_leaves_the_queue_and_the_next_one_runs():
    async def go():
        async with engine_of(max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", max_tokens=50))  # 60
            b = await submit(engine, req("b", max_tokens=80))  # 90: waits at the head
            c = await submit(engine, req("c", prompt=5, max_tokens=5))  # 10: waits behind b
            b.cancel()
            await asyncio.wait({b})
            await until(lambda: started(engine) == ["a", "c"], "c started once b left")
            assert (engine.running, engine.waiting, engine.kv_reserved) == (2, 0, 70)
            assert aborted(engine) == []  # b never reached the target
            for rid in "ac":
                finish(engine, rid)
            await asyncio.gather(a, c)
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


def test_abort_all_fails_running_and_waiting_requests_and_releases_everything():
    async def go():
        async with engine_of(max_kv_tokens=100) as engine:
            a = await submit(engine, req("a", max_tokens=50))
            b = await submit(engine, req("b", max_tokens=40), waiting=1)
            await engine.abort_all("stopped by the drain")
            for task in (a, b):
                with pytest.raises(RequestError) as err:
                    await task
                assert err.value.status == 503 and "drain" in str(err.value)
            assert (engine.in_flight, engine.kv_reserved) == (0, 0) and started(engine) == ["a"]
    asyncio.run(go())


def test_an_admission_never_taken_up_is_given_back():
    async def go():
        async with engine_of(max_num_seqs=1, max_kv_tokens=100) as engine:
            engine.admit(req("a", max_tokens=50))  # runs at once
            engine.admit(req("b", max_tokens=40))  # waits
            assert (engine.running, engine.waiting, engine.kv_reserved) == (1, 1, 60)
            engine.discard("a")  # e.g. the client left before its stream started
            assert (engine.running, engine.waiting, engine.kv_reserved) == (1, 0, 50)
            engine.discard("b")
            engine.discard("b")  # idempotent
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


# ------------------------------------------------------------------ refused at once


def test_a_request_larger_than_the_whole_budget_is_refused_not_queued():
    async def go():
        async with engine_of(max_kv_tokens=100) as engine:
            with pytest.raises(KVBudgetExceeded) as err:
                engine.admit(req("big", prompt=10, max_tokens=95))
            assert err.value.status == 400 and "max_tokens" in str(err.value) and "100" in str(err.value)
            with pytest.raises(KVBudgetExceeded):
                await consume(engine, req("big2", prompt=10, max_tokens=95))
            assert (engine.in_flight, engine.kv_reserved) == (0, 0) and started(engine) == []
    asyncio.run(go())


def test_beyond_max_waiting_a_request_is_refused():
    async def go():
        async with engine_of(max_num_seqs=1, max_waiting=1) as engine:
            a = await submit(engine, req("a"), running=1)
            b = await submit(engine, req("b"), waiting=1)
            assert not engine.can_admit()
            with pytest.raises(QueueFull):
                engine.admit(req("c"))
            assert engine.in_flight == 2
            for rid, task in (("a", a), ("b", b)):
                await until(lambda: rid in started(engine), f"{rid} started")
                finish(engine, rid)
                await task
        # A full KV budget with nobody waiting and max_waiting 0: refused too, never queued.
        async with engine_of(max_kv_tokens=100, max_waiting=0) as engine:
            a = await submit(engine, req("a", max_tokens=50))
            with pytest.raises(QueueFull):
                engine.admit(req("b", max_tokens=40))
            finish(engine, "a")
            await a
            assert (engine.in_flight, engine.kv_reserved) == (0, 0)
    asyncio.run(go())


# ------------------------------------------------------------------ through the HTTP app

COMPLETION = {"model": MODEL, "prompt": "x" * 10, "max_tokens": 40}


@asynccontextmanager
async def app_over(engine):
    from foresight.server.app import create_app

    async def noop():
        pass

    engine.start = engine.stop = noop
    app = create_app(ServerConfig(), engine=engine, tokenizer=ByteTokenizer())
    async with app.router.lifespan_context(app):
        yield app


def test_http_400_for_a_request_over_the_budget_and_429_beyond_max_waiting_before_any_stream():
    async def go():
        async with engine_of(max_model_len=512, max_num_seqs=1, max_waiting=1, max_kv_tokens=100) as engine:
            async with app_over(engine) as app:
                big = await call(app, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 95, "stream": True})
                assert big.status == 400, big.body
                err = big.json()["error"]
                assert err["param"] == "max_tokens" and "100" in err["message"] and "max_tokens" in err["message"]
                health = (await call(app, "GET", "/health")).json()
                assert health["kv_tokens"] == {"reserved": 0, "budget": 100} and health["max_num_seqs"] == 1

                first = asyncio.ensure_future(call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True}))
                await until(lambda: engine.running == 1, "the first request running")
                second = asyncio.ensure_future(call(app, "POST", "/v1/completions", COMPLETION))
                await until(lambda: engine.waiting == 1, "the second request waiting")
                assert (await call(app, "GET", "/health")).json()["kv_tokens"]["reserved"] == 50
                full = await call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True})
                assert full.status == 429 and full.json()["error"]["type"] == "rate_limit_error"

                finish(engine, started(engine)[0])
                await until(lambda: len(started(engine)) == 2, "the second request started")
                finish(engine, started(engine)[1])
                one, two = await asyncio.gather(first, second)
                assert one.status == 200 and one.events()[-1] == "[DONE]"
                assert all("error" not in json.loads(e) for e in one.events()[:-1])
                assert two.status == 200 and two.json()["choices"][0]["finish_reason"] == "length"
                assert (engine.in_flight, engine.kv_reserved) == (0, 0)
                text = (await call(app, "GET", "/metrics")).body.decode()
                assert f'foresight_request_failure_total{{model_name="{MODEL}",reason="queue_full"}} 1.0' in text
                assert f'foresight_request_failure_total{{model_name="{MODEL}",reason="bad_request"}} 1.0' in text
    asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_http_client_that_disconnects_while_queued_gives_its_place_back(stream):
    async def go():
        async with engine_of(max_model_len=512, max_num_seqs=1, max_kv_tokens=100) as engine:
            async with app_over(engine) as app:
                first = asyncio.ensure_future(call(app, "POST", "/v1/completions", COMPLETION))
                await until(lambda: engine.running == 1, "the first request running")
                gone = asyncio.Event()
                queued = asyncio.ensure_future(call(app, "POST", "/v1/completions",
                                                    {**COMPLETION, "stream": stream}, gone=gone))
                await until(lambda: engine.waiting == 1, "the second request waiting")
                gone.set()
                await asyncio.wait_for(queued, 10)
                assert (engine.running, engine.waiting, engine.kv_reserved) == (1, 0, 50)
                finish(engine, started(engine)[0])
                assert (await first).status == 200
                assert (engine.in_flight, engine.kv_reserved) == (0, 0) and len(started(engine)) == 1
    asyncio.run(go())


# ------------------------------------------------------------------ flags and validation


def serve_config(*argv) -> ServerConfig:
    from foresight.cli import build_parser

    args = build_parser().parse_args(["serve", *argv])
    return server_from_args(args, engine_from_args(args))


def test_admission_flags_reach_the_server_config_and_max_running_is_an_alias():
    default = serve_config()
    assert (default.max_num_seqs, default.max_kv_tokens, default.max_waiting) == (16, None, 64)
    assert serve_config("--max-num-seqs", "5").max_num_seqs == 5
    assert serve_config("--max-running", "3").max_num_seqs == 3
    cfg = serve_config("--max-kv-tokens", "4096", "--max-waiting", "2")
    assert (cfg.max_kv_tokens, cfg.max_waiting) == (4096, 2)


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_waiting", -1), ("max_kv_tokens", 0),
                                         ("max_kv_tokens", -5)])
def test_admission_config_is_validated_naming_the_parameter(field, value):
    with pytest.raises(ConfigError) as err:
        ServerConfig(**{field: value})
    assert field in str(err.value)
