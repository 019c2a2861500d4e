"""`foresight serve --target-cores 0 --drafter-cores 1` on the real default: each worker process and every one of
its threads runs on its own core only, and the server answers (placement.py)."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from support.live_server import wait_health

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                                reason="needs cores 0 and 1")


def allowed_cores(pid: int, task: int | None = None) -> str:
    status = Path(f"/proc/{pid}/task/{task}/status" if task else f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def thread_cores(pid: int) -> set[str]:
    return {allowed_cores(pid, int(task)) for task in os.listdir(f"/proc/{pid}/task")}


def test_each_worker_and_its_threads_stay_on_their_own_core(server_factory):
    # --compile off: a pinned target never borrows the drafter's core, so its graphs would be another set
    # (one thread), compiled for minutes; what is tested here is where the processes run.
    with server_factory("--target-cores", "0", "--drafter-cores", "1", "--compile", "off") as server:
        workers = wait_health(server, 200)["workers"]
        reply = httpx.post(server + "/v1/completions", timeout=120,
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"]
        assert allowed_cores(workers["target"]) == "0" and thread_cores(workers["target"]) == {"0"}
        assert allowed_cores(workers["drafter"]) == "1" and thread_cores(workers["drafter"]) == {"1"}
        assert "target: pinned to core(s) 0" in server.log() and "drafter: pinned to core(s) 1" in server.log()
