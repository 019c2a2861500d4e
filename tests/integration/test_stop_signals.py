"""Stop signals at the edges of a live server's life: during start-up, and a second Ctrl-C mid-drain.

Bounded waits with generous timeouts only: nothing here depends on how fast this machine is."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from support.live_server import leftovers, pid_exists, stream_completion, wait_health

pytestmark = pytest.mark.integration


BODY = {"prompt": "Count from one to one hundred: one, two,", "temperature": 0, "ignore_eos": True}


def workers_of(pid: int) -> list[int]:
    """The worker processes `pid` has spawned (multiprocessing's resource tracker is not one)."""
    found = []
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for kid in kids:
        try:
            if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                found.append(int(kid))
        except OSError:
            pass  # gone meanwhile
    return found


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def test_sigterm_before_serving_exits_0_and_leaves_nothing(server_spawner):
    """SIGTERM while the server is still importing and loading its tokenizer (no workers yet)."""
    server = server_spawner()
    time.sleep(0.5)
    server.process.terminate()
    assert server.process.wait(timeout=60) == 0, server.log()
    assert leftovers([server.process.pid]) == []


def test_sigterm_while_the_workers_load_stops_them_at_once_and_exits_0(server_spawner):
    server = server_spawner()
    wait_until(lambda: workers_of(server.process.pid) or server.process.poll() is not None, 600,
               "no worker was started")
    workers = workers_of(server.process.pid)
    server.process.terminate()
    assert server.process.wait(timeout=120) == 0, server.log()
    log = server.log()
    assert "during start-up" in log and "Traceback" not in log, log
    assert "could not take" not in log, log  # no wait for a target that cannot hear yet
    wait_until(lambda: not [p for p in workers if pid_exists(p)], 30, "a worker outlived the server")
    assert leftovers([server.process.pid, *workers]) == []


def test_a_second_sigint_ends_the_drain_streams_get_an_error_and_done(server_spawner):
    server = server_spawner("--drain-timeout", "600")
    pids = wait_health(server, 200, timeout_s=1200)["workers"]
    everyone = [server.process.pid, pids["target"], pids["drafter"]]
    results = [dict() for _ in range(2)]
    started = [threading.Event() for _ in results]

    def run(i: int) -> None:
        results[i].update(stream_completion(server, {**BODY, "max_tokens": 2000},
                                            lambda n: n == 1 and started[i].set()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(timeout=300), "a stream never started"
    server.process.send_signal(signal.SIGINT)  # SIGINT: drain (600 s)
    wait_health(server, 503, timeout_s=60, until=lambda b: b["status"] == "draining")
    server.process.send_signal(signal.SIGINT)  # again: stop now
    for t in threads:
        t.join(timeout=120)
    for r in results:
        assert r["status"] == 200 and r["done"] and len(r["errors"]) == 1, r
        assert "second interrupt" in r["errors"][0]["message"], r
    assert server.process.wait(timeout=120) == 0, server.log()
    assert "CancelledError" not in server.log(), server.log()
    wait_until(lambda: not [p for p in everyone if pid_exists(p)], 30, "a process outlived the server")
    assert leftovers(everyone) == []
