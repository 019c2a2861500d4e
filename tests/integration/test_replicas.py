"""Replicas behind the repository's HAProxy config (deploy/haproxy/haproxy.cfg, run on loopback by
foresight/bench/replicas.py): a replica whose /health is 503 gets no request a client can see; two real
`foresight serve` replicas under streaming load through the official `openai` client, one SIGTERMed (it drains:
0 failed requests) and, restarted, the other SIGKILLed (only its in-flight requests fail, each with an error the
client raises; every request started after one health-check interval succeeds).

Needs Debian's `haproxy` (each test skips with the reason when it is missing).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from foresight.bench.replicas import HAPROXY_CFG, loopback_config, running_balancer

pytestmark = pytest.mark.integration

# Small servers: plain decoding, eager steps (no compile at start), two sequences at a time, a core each.
REPLICA_ARGS = ["--mode", "ar", "--compile", "off", "--max-num-seqs", "2", "--drain-timeout", "120",
                "--target-threads", "1", "--drafter-threads", "1"]
CHECK_INTERVAL_S = 1.0  # `inter` of the deployed config's default-server line


def haproxy_or_skip() -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("`haproxy` not on PATH (apt-get install -y --no-install-recommends haproxy)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loopback_config_keeps_the_deployed_settings():
    text = HAPROXY_CFG.read_text()
    local = loopback_config(text, [9001, 9002], 9000, 9404)
    assert "bind 127.0.0.1:9000" in local and "bind 127.0.0.1:9404" in local
    assert "server replica1 127.0.0.1:9001" in local and "server replica2 127.0.0.1:9002" in local
    assert "server-template" not in local
    kept = [line for line in text.splitlines() if "bind :" not in line and "server-template" not in line]
    assert all(line in local.splitlines() for line in kept)
    for setting in ("balance leastconn", "option httpchk GET /health", "http-check expect status 200",
                    "retry-on conn-failure 503"):
        assert setting in text
    with pytest.raises(ValueError, match="server-template"):
        loopback_config(text.replace("server-template", "server"), [9001], 9000, 9404)


# ------------------------------------------------------------------ stand-in replicas


@contextmanager
def stand_in(health: int, counts: dict):
    """An HTTP server answering GET /health with `health` and every POST with that status too (a loading or
    draining replica answers 503 to both); `counts[port]` counts the POSTs it received."""

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self.reply(health, {"status": "ok" if health == 200 else "loading"})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            counts[port] = counts.get(port, 0) + 1
            self.reply(health, {"ok": health == 200})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield port
    finally:
        httpd.shutdown()
        httpd.server_close()


def post(url: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_replica_whose_health_is_503_gets_no_request(tmp_path):
    haproxy_or_skip()
    counts: dict[int, int] = {}
    with stand_in(200, counts) as ready, stand_in(503, counts) as loading, \
            running_balancer([ready, loading], free_port(), free_port(), tmp_path) as balancer:
        statuses = [post(balancer.api_url + "/v1/completions") for _ in range(10)]  # maybe before the first check
        balancer.wait_for("replica2", "DOWN", timeout_s=10)
        marked_down = counts.get(loading, 0)
        statuses += [post(balancer.api_url + "/v1/completions") for _ in range(30)]
        state = balancer.replicas()
    assert statuses == [200] * 40  # a 503 from the loading replica is retried on the ready one
    assert counts.get(loading, 0) == marked_down  # nothing more once the check has marked it down
    assert counts[ready] >= 30 and state["replica2"].status == "DOWN"
    assert state["replica2"].redispatched == marked_down  # each of those few went on to the ready replica


# ------------------------------------------------------------------ real replicas


class Clients:
    """`n` threads sending streamed chat requests through the balancer until stopped; each result is
    (start, end, error or None)."""

    def __init__(self, base_url: str, n: int):
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.model = self.client.models.list().data[0].id
        self.results: list[tuple[float, float, Exception | None]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(n)]

    def loop(self, index: int) -> None:
        prompts = ["Count from 1 to 20.", "Name five rivers.", "Describe a cat.", "What is a prime number?"]
        i = 0
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                stream = self.client.chat.completions.create(
                    model=self.model, stream=True, max_tokens=16, temperature=0,
                    messages=[{"role": "user", "content": prompts[(index + i) % len(prompts)]}])
                chunks = [c for c in stream]
                assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1:]
                error = None
            except (openai.APIError, AssertionError) as exc:  # what a client sees; anything else is a test bug
                error = exc
            self.results.append((start, time.monotonic(), error))
            i += 1

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=320)


def running_requests(server) -> float:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("foresight_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_drain_and_failover_through_the_balancer(tmp_path, server_factory):
    haproxy_or_skip()
    with ExitStack() as stack:
        a = stack.enter_context(server_factory(*REPLICA_ARGS, name="a"))
        b = stack.enter_context(server_factory(*REPLICA_ARGS, name="b"))
        balancer = stack.enter_context(running_balancer([a.port, b.port], free_port(), free_port(), tmp_path))
        balancer.wait_for("replica1", "UP")
        balancer.wait_for("replica2", "UP")

        # SIGTERM: replica1 drains. Its /health answers 503 at once, the balancer stops sending to it, what
        # runs on it finishes; not one request fails.
        with Clients(balancer.api_url, 4) as clients:
            wait_until(lambda: running_requests(a) > 0, 300, "requests running on replica1")
            a.process.send_signal(signal.SIGTERM)
            assert balancer.wait_for("replica1", "DOWN", timeout_s=10) < 5 * CHECK_INTERVAL_S
            a.process.wait(timeout=300)
            drained_at = time.monotonic()
            wait_until(lambda: any(start > drained_at for start, _, _ in clients.results), 300,
                       "a request after replica1 stopped")
        failed = [err for _, _, err in clients.results if err is not None]
        assert a.process.returncode == 0, a.log()
        assert not failed, f"{len(failed)} of {len(clients.results)} failed during the drain: {failed[:3]}"

        # replica1 again on its port; then SIGKILL replica2 (api and workers at once): the requests in flight
        # on it fail with an error the client raises, new ones succeed.
        stack.enter_context(server_factory(*REPLICA_ARGS, name="a2", port=a.port))
        balancer.wait_for("replica1", "UP", timeout_s=30)
        with Clients(balancer.api_url, 4) as clients:
            wait_until(lambda: running_requests(b) > 0, 300, "requests running on replica2")
            os.killpg(b.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            wait_until(lambda: sum(start > killed_at + CHECK_INTERVAL_S for start, _, _ in clients.results) >= 8,
                       300, "requests after the kill")
        assert balancer.replicas()["replica2"].status.startswith("DOWN")
    before = [(start, err) for start, _, err in clients.results if start <= killed_at]
    after = [(start, err) for start, _, err in clients.results if start > killed_at + CHECK_INTERVAL_S]
    failed_before = [err for _, err in before if err is not None]
    assert failed_before, "the kill hit no request in flight: nothing was tested"
    assert all(isinstance(err, openai.APIError) for err in failed_before), failed_before
    assert all(err is None for _, err in after), [err for _, err in after if err is not None][:3]
