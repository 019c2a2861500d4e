"""Probing a live `foresight serve` from integration tests: health, metrics, streamed completions."""
from __future__ import annotations

import glob
import json
import os
import time

import httpx


def wait_health(base: str, want: int, timeout_s: float = 180.0, until=lambda body: True) -> dict:
    """The /health body once it answers `want` and `until(body)` holds."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{base}/health", timeout=5)
        except httpx.TransportError as exc:  # e.g. the server is stopping: keep asking until the deadline
            last = repr(exc)
            time.sleep(0.1)
            continue
        last = resp.json()
        if resp.status_code == want and until(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"/health never answered {want} with the wanted state; last: {last}")


def metric_value(base: str, name: str, worker: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and f'worker="{worker}"' in line:
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing")


def restarts_metric(base: str, worker: str) -> float:
    return metric_value(base, "foresight_worker_restarts_total", worker)


def stream_completion(base: str, body: dict, on_event=None) -> dict:
    """A streamed completion: status, text, usage, error events, whether [DONE] came. `on_event(n)` is
    called after the n-th data event."""
    result = {"text": "", "usage": None, "errors": [], "done": False, "finish_reason": None}
    with httpx.stream("POST", f"{base}/v1/completions", timeout=300,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        result["status"] = resp.status_code
        n = 0
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                result["errors"].append(event["error"])
            for choice in event.get("choices", []):
                result["text"] += choice.get("text") or ""
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
            result["usage"] = event.get("usage") or result["usage"]
            n += 1
            if on_event is not None:
                on_event(n)
    return result


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def leftovers(pids: list[int]) -> list[str]:
    """Socket folders and shared-memory segments named after any of `pids`."""
    found = []
    for pid in pids:
        found += glob.glob(f"/tmp/foresight-zmq-{pid}x*") + glob.glob(f"/dev/shm/foresight_{pid}x*")
    return found
