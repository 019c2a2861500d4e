"""Faults injected into a live server: a stopped (hung) drafter, and SIGTERM with streams in flight.

Bounded waits with generous timeouts only: nothing here depends on how fast this machine is."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from support.live_server import leftovers, pid_exists, stream_completion, wait_health

pytestmark = pytest.mark.integration

BODY = {"prompt": "Count from one to one hundred: one, two,", "temperature": 0, "ignore_eos": True}


def test_stopped_drafter_is_found_hung_killed_and_replaced(server_factory):
    n_tokens = 100
    with server_factory("--heartbeat-timeout", "4") as server:
        pids = wait_health(server, 200)["workers"]
        stopped = pids["drafter"]
        result, seen_degraded = {}, []

        def stop_drafter(n_events: int) -> None:
            if n_events == 2:
                os.kill(stopped, signal.SIGSTOP)

        thread = threading.Thread(target=lambda: result.update(
            stream_completion(server, {**BODY, "max_tokens": n_tokens}, stop_drafter)))
        thread.start()
        try:
            # While the drafter is found hung and a new one loads, the server still serves: 200, degraded.
            health = wait_health(server, 200, timeout_s=120, until=lambda b: b["status"] == "degraded")
            seen_degraded.append(health)
            thread.join(timeout=300)
            assert not thread.is_alive()
            assert result["status"] == 200 and result["done"] and not result["errors"], result
            assert result["usage"]["completion_tokens"] == n_tokens

            health = wait_health(server, 200, until=lambda b: b["status"] == "ok"
                                 and b["workers"]["drafter"] not in (None, stopped))
            drafter = health["worker_state"]["drafter"]
            assert drafter["restarts"] >= 1 and "hung" in drafter["last_fault"], drafter
            assert health["workers"]["target"] == pids["target"]
            deadline = time.monotonic() + 30
            while pid_exists(stopped) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not pid_exists(stopped), "the hung drafter was not killed"
        finally:
            if pid_exists(stopped):  # never leave a stopped process behind
                os.kill(stopped, signal.SIGCONT)
                os.kill(stopped, signal.SIGKILL)
        resp = httpx.post(f"{server}/v1/completions", json={**BODY, "max_tokens": 5}, timeout=120)
        assert resp.status_code == 200


def test_sigterm_drains_streams_exits_0_and_leaves_nothing(server_factory):
    n_tokens, n_streams = 60, 3
    with server_factory("--drain-timeout", "600") as server:
        pids = wait_health(server, 200)["workers"]
        everyone = [server.process.pid, pids["target"], pids["drafter"]]
        results = [dict() for _ in range(n_streams)]
        started = [threading.Event() for _ in range(n_streams)]

        def run(i: int) -> None:
            def first_tokens(n_events: int) -> None:
                if n_events == 1:
                    started[i].set()
            results[i].update(stream_completion(server, {**BODY, "max_tokens": n_tokens}, first_tokens))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_streams)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(timeout=300), "a stream never started"
        server.process.send_signal(signal.SIGTERM)

        # Draining: the listener stays open, /health fails, and new requests hear why they are refused.
        wait_health(server, 503, timeout_s=60, until=lambda b: b["status"] == "draining")
        refused = httpx.post(f"{server}/v1/completions", json={**BODY, "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]

        for t in threads:
            t.join(timeout=600)
        for r in results:
            assert r["status"] == 200 and r["done"] and not r["errors"], r
            assert r["usage"]["completion_tokens"] == n_tokens
        assert server.process.wait(timeout=120) == 0
        assert not [p for p in everyone if pid_exists(p)], "a process outlived the server"
        assert leftovers(everyone) == []


def test_drain_timeout_stops_what_is_left_with_a_clear_error(server_factory):
    with server_factory("--drain-timeout", "1") as server:
        everyone = [server.process.pid, *wait_health(server, 200)["workers"].values()]

        def sigterm(n_events: int) -> None:
            if n_events == 1:
                server.process.send_signal(signal.SIGTERM)

        got = stream_completion(server, {**BODY, "max_tokens": 1000}, sigterm)
        assert got["done"] and len(got["errors"]) == 1, got
        assert "drain timeout" in got["errors"][0]["message"] and got["errors"][0]["code"] == 503
        assert server.process.wait(timeout=120) == 0
        assert leftovers(everyone) == []
