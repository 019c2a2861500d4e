"""Admission and cancellation: a full queue answers 429, a client that goes away aborts its request."""
from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.integration

LONG = {"prompt": "Count from one to one thousand: one, two,", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


def metric(base: str, prefix: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    raise AssertionError(f"{prefix} not exported")


def test_full_queue_is_429_and_disconnect_aborts(server_factory):
    with server_factory("--max-num-seqs", "1", "--max-waiting", "0") as server:
        # Hold the only slot with a streaming request, then drop the connection after a few chunks.
        with httpx.stream("POST", f"{server}/v1/completions", json={**LONG, "stream": True}, timeout=120) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(f"{server}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
            assert busy.status_code == 429, busy.text
            assert busy.json()["error"]["type"] == "rate_limit_error"
        # The stream is closed: the request must be aborted, freeing the slot well before 400 tokens.
        deadline = time.monotonic() + 30
        while metric(server, "foresight_requests_running{") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(server, "foresight_requests_running{") == 0
        assert metric(server, 'foresight_request_success_total{finished_reason="abort"') == 1
        assert metric(server, 'foresight_request_failure_total{model_name="SmolLM2-135M-Instruct",reason="queue_full"}') == 1
        ok = httpx.post(f"{server}/v1/completions", json={**LONG, "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        # A non-streaming client that gives up aborts its request too, long before 400 tokens.
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server}/v1/completions", json=LONG, timeout=1.0)
        deadline = time.monotonic() + 30
        while metric(server, "foresight_requests_running{") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(server, "foresight_requests_running{") == 0
        assert metric(server, 'foresight_request_success_total{finished_reason="abort"') == 2
