"""Fault drill: what clients see when workers fail, measured on a live `foresight serve` (loopback only).

    .venv/bin/python scripts/fault_drill.py --out drill.json [--serve-args "--dtype float32"]

One server runs its scenarios in order. First a client that leaves a long request after ~1 s (streaming,
then not): how soon generation stops, in seconds and rounds. Then four fault scenarios, each with greedy
streaming requests in flight (`ignore_eos`, so they run their full length): the drafter SIGKILLed three times; the drafter SIGSTOPped (hung); the
target SIGKILLed; SIGTERM. Per scenario: requests completed (HTTP 200, `[DONE]`, every token), failed
(an error status or error event) and lost (no answer at all), the longest pause between two events of a
stream, and recovery times. Every wait is bounded; the server is killed if anything overruns.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Count from one to one hundred: one, two,"
WAIT_S = 600.0  # the most any one wait may take


class Stream(threading.Thread):
    """One streamed completion in a thread, with the time of every event."""

    def __init__(self, base: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.status, self.done, self.errors, self.tokens, self.times, self.exc = None, False, [], 0, [], None

    def run(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=WAIT_S) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self._event(line[len("data: "):])
        except Exception as exc:  # a dropped connection: the request is lost
            self.exc = repr(exc)

    def _event(self, data: str) -> None:
        self.times.append(time.monotonic())
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            self.errors.append(event["error"]["message"])
        if event.get("usage"):
            self.tokens = event["usage"]["completion_tokens"]

    def outcome(self) -> str:
        if self.status == 200 and self.done and not self.errors and self.tokens == self.max_tokens:
            return "completed"
        if self.status not in (None, 200) or self.errors:
            return "failed"
        return "lost"

    def max_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def start_streams(base: str, n: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(base, max_tokens) for _ in range(n)]
    for s in streams:
        s.start()
    wait_for(lambda: all(len(s.times) >= 2 or not s.is_alive() for s in streams), "streams to start")
    return streams


def finish(streams: list[Stream]) -> dict:
    for s in streams:
        s.join(WAIT_S)
    counts = {k: sum(s.outcome() == k for s in streams) for k in ("completed", "failed", "lost")}
    return {**counts, "max_pause_s": round(max(s.max_gap_s() for s in streams), 2),
            "errors": sorted({e for s in streams for e in s.errors})}


def wait_for(cond, what: str, timeout_s: float = WAIT_S, period_s: float = 0.05) -> float:
    """Seconds until `cond()` held."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(period_s)
    return time.monotonic() - t0


def health(base: str) -> tuple[int | None, dict]:
    try:
        resp = httpx.get(f"{base}/health", timeout=5)
        return resp.status_code, resp.json()
    except httpx.TransportError:
        return None, {}


def pids(base: str) -> dict:
    return health(base)[1]["workers"]


def drafter_back(base: str, old_pid: int):
    def check() -> bool:
        code, body = health(base)
        return code == 200 and body.get("status") == "ok" and body["workers"]["drafter"] not in (None, old_pid)
    return check


def metric(base: str, name: str) -> float:
    """The first sample of a Prometheus metric family (one model: one label set)."""
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


# ---------------------------------------------------------------- scenarios


def client_disconnect(base: str, stream: bool, max_tokens: int = 400) -> dict:
    """A long request whose client leaves after ~1 s: how soon the server stops generating for it, in
    seconds and in rounds (the mean verification round of the run so far)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=60) as client:
        if stream:
            with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                events = (line for line in resp.iter_lines() if line.startswith("data: "))
                for _ in range(3):
                    next(events)
        else:
            try:
                client.post(f"{base}/v1/completions", json=body, timeout=1.0)
            except httpx.ReadTimeout:
                pass
    stopped_s = wait_for(lambda: metric(base, "foresight_requests_running") == 0, "the abandoned request to stop", 60)
    round_s = metric(base, "foresight_verify_latency_seconds_sum") / metric(base, "foresight_verify_latency_seconds_count")
    return {"stopped_after_s": round(stopped_s, 3), "mean_round_s": round(round_s, 4),
            "rounds": round(stopped_s / round_s, 1)}



def drafter_sigkill(base: str, rounds: int = 3, streams: int = 4, max_tokens: int = 120) -> dict:
    runs = []
    for _ in range(rounds):
        victim = pids(base)["drafter"]
        live = start_streams(base, streams, max_tokens)
        os.kill(victim, signal.SIGKILL)
        restart_s = wait_for(drafter_back(base, victim), "the drafter to come back")
        runs.append({**finish(live), "drafter_back_after_s": round(restart_s, 1)})
    totals = {k: sum(r[k] for r in runs) for k in ("completed", "failed", "lost")}
    return {"rounds": runs, **totals, "target_pid_unchanged": True}


def drafter_sigstop(base: str, streams: int = 4, max_tokens: int = 120) -> dict:
    victim = pids(base)["drafter"]
    live = start_streams(base, streams, max_tokens)
    os.kill(victim, signal.SIGSTOP)
    try:
        noticed_s = wait_for(lambda: health(base)[1].get("status") == "degraded", "/health to say degraded")
        back_s = wait_for(drafter_back(base, victim), "a new drafter")
        result = finish(live)
        code, body = health(base)
        killed = wait_for(lambda: not pid_alive(victim), "the stopped drafter to be killed", timeout_s=30) >= 0
    finally:
        if pid_alive(victim):
            os.kill(victim, signal.SIGCONT)
            os.kill(victim, signal.SIGKILL)
    return {**result, "degraded_after_s": round(noticed_s, 1), "new_drafter_after_s": round(noticed_s + back_s, 1),
            "stopped_drafter_killed": killed, "last_fault": body["worker_state"]["drafter"]["last_fault"]}


def target_sigkill(base: str, streams: int = 2, max_tokens: int = 400) -> dict:
    victim = pids(base)["target"]
    live = start_streams(base, streams, max_tokens)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: health(base)[0] == 503, "/health to answer 503", timeout_s=30, period_s=0.01)
    recovered_s = wait_for(lambda: health(base)[0] == 200, "/health 200 again")
    return {**finish(live), "health_200_again_after_s": round(time.monotonic() - t0, 1),
            "unavailable_s": round(recovered_s, 1)}


def sigterm(base: str, server: subprocess.Popen, streams: int = 3, max_tokens: int = 120) -> dict:
    everyone = [server.pid, *pids(base).values()]
    semaphores = set(glob.glob("/dev/shm/sem.*"))
    live = start_streams(base, streams, max_tokens)
    t0 = time.monotonic()
    server.send_signal(signal.SIGTERM)
    wait_for(lambda: health(base)[1].get("status") == "draining", "/health to say draining", timeout_s=30)
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    result = finish(live)
    code = server.wait(WAIT_S)
    return {**result, "new_request_during_drain": refused.status_code, "exit_code": code,
            "exit_after_s": round(time.monotonic() - t0, 1),
            "processes_left": [p for p in everyone if pid_alive(p)],
            "socket_folders_left": sorted(glob.glob(f"/tmp/foresight-zmq-{server.pid}x*")),
            "shm_segments_left": sorted(f for p in everyone for f in glob.glob(f"/dev/shm/foresight_{p}x*")),
            "new_semaphores": sorted(set(glob.glob("/dev/shm/sem.*")) - semaphores)}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--serve-args", default="", help="extra `foresight serve` flags")
    parser.add_argument("--only-disconnect", action="store_true",
                        help="only the client-disconnect scenarios (no worker faults)")
    args = parser.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "foresight.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(args.serve_args)]
    log_path = args.out.with_suffix(".server.log")
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    report = {"command": shlex.join(cmd), "server_log": str(log_path)}
    try:
        report["startup_s"] = round(wait_for(lambda: health(base)[0] == 200, "the server to start"), 1)
        report["disconnect_streaming"] = client_disconnect(base, stream=True)
        report["disconnect_non_streaming"] = client_disconnect(base, stream=False)
        if not args.only_disconnect:
            target = pids(base)["target"]
            report["drafter_sigkill_x3"] = drafter_sigkill(base)
            report["drafter_sigkill_x3"]["target_pid_unchanged"] = pids(base)["target"] == target
            report["drafter_sigstop"] = drafter_sigstop(base)
            report["target_sigkill"] = target_sigkill(base)
            report["sigterm"] = sigterm(base, server)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
