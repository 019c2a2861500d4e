#!/usr/bin/env python3
"""Soak test: minutes of mixed OpenAI traffic against a Foresight server on 127.0.0.1.

The mix: chat and completions, streaming and not; clients that disconnect mid-stream or stop waiting for
a non-streaming answer; bad input (malformed JSON, out-of-range parameters, an unknown model, a body over
the size limit). A few clients run at once (--concurrency), each sending one request after another until
the time (--minutes) or the request budget (--max-requests) is spent.

Every request lands in one category:
  completed     2xx on a request that should succeed (a stream must end with `data: [DONE]`, no error event)
  rejected      the expected 4xx, OpenAI-shaped, on bad input
  disconnected  the client left on purpose (mid-stream, or it stopped waiting)
  failed        5xx, an unexpected status, an error event in a stream, a malformed answer
  lost          no answer or a connection error on a request that should have succeeded

It also records the resident memory of the api and both workers (the api's process tree under /proc, the
worker pids from GET /health) at the start, every --sample-every seconds and at the end; checks that the
server is idle again once the traffic stops (no request left running after the disconnects); and counts
worker restarts. Without --url it starts `foresight serve` on a free loopback port and stops it after.

Exit status: 0 when nothing failed or was lost and the server went idle, 1 otherwise, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("completed", "rejected", "disconnected", "failed", "lost")
DEFAULT_BODY_LIMIT = 4 << 20  # the server's default --max-request-bytes
MAX_EXAMPLES = 20  # failed or lost requests kept in the report, with what the server said

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Explain recursion in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about the sea.",
    "import numpy as np\n",
]


# ------------------------------------------------------------------ categories and the tally


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    by_scenario: dict = field(default_factory=lambda: defaultdict(Counter))
    latencies: dict = field(default_factory=lambda: defaultdict(list))
    examples: list = field(default_factory=list)

    def record(self, scenario: str, category: str, latency_s: float, detail: str | None = None) -> None:
        self.counts[category] += 1
        self.by_scenario[scenario][category] += 1
        if category == "completed":
            self.latencies[scenario].append(latency_s)
        if category in ("failed", "lost") and len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"scenario": scenario, "category": category, "detail": (detail or "")[:500]})

    def to_dict(self) -> dict:
        scenarios = {}
        for name, counts in sorted(self.by_scenario.items()):
            scenarios[name] = {c: counts[c] for c in CATEGORIES if counts[c]}
            scenarios[name].update(latency_summary(self.latencies.get(name, [])))
        requests = {"sent": sum(self.counts.values()), **{c: self.counts[c] for c in CATEGORIES}}
        return {"requests": requests, "by_scenario": scenarios, "examples": self.examples}


def latency_summary(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
    return {"latency_p50_s": pick(0.5), "latency_p95_s": pick(0.95), "latency_max_s": round(ordered[-1], 3)}


def is_openai_error(body: bytes, status: int) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["code"] == status


# ------------------------------------------------------------------ the scenarios


@dataclass
class Ctx:
    client: httpx.AsyncClient
    url: str
    model: str
    rng: random.Random
    max_tokens: int
    body_limit: int


def good_body(ctx: Ctx, chat: bool, stream: bool, max_tokens: int | None = None) -> dict:
    """A valid request with varied sampling settings."""
    prompt = ctx.rng.choice(PROMPTS)
    body = {"model": ctx.model, "stream": stream, "max_tokens": max_tokens or ctx.rng.randint(1, ctx.max_tokens),
            "temperature": ctx.rng.choice([0.0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ctx.rng.random() < 0.3:
        body["seed"] = ctx.rng.randint(0, 2**31)
    if ctx.rng.random() < 0.2:
        body["stop"] = ["\n\n"]
    if ctx.rng.random() < 0.2:
        body["verification"] = "nucleus"
    if stream and ctx.rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def plain(ctx: Ctx, chat: bool) -> tuple[str, str | None]:
    try:
        r = await ctx.client.post(ctx.url + path_of(chat), json=good_body(ctx, chat, stream=False))
    except httpx.HTTPError as exc:
        return "lost", f"{type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return "failed", f"status {r.status_code}: {r.text[:300]}"
    try:
        choices = r.json()["choices"]
    except (ValueError, KeyError):
        return "failed", f"malformed body: {r.text[:300]}"
    return ("completed", None) if choices else ("failed", f"no choices: {r.text[:300]}")


def stream_verdict(events: list[str]) -> tuple[str, str | None]:
    """A stream that reached `[DONE]` without an error event completed; one cut short was lost."""
    for payload in events:
        if payload != "[DONE]" and '"error"' in payload:
            try:
                if "error" in json.loads(payload):
                    return "failed", f"error event: {payload[:300]}"
            except ValueError:
                return "failed", f"malformed event: {payload[:300]}"
    if not events or events[-1] != "[DONE]":
        return "lost", f"stream ended without [DONE] after {len(events)} events"
    return "completed", None


async def streamed(ctx: Ctx, chat: bool) -> tuple[str, str | None]:
    events: list[str] = []
    try:
        async with ctx.client.stream("POST", ctx.url + path_of(chat), json=good_body(ctx, chat, stream=True)) as r:
            if r.status_code != 200:
                return "failed", f"status {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    except httpx.HTTPError as exc:
        return "lost", f"{type(exc).__name__} after {len(events)} events: {exc}"
    return stream_verdict(events)


async def leave_mid_stream(ctx: Ctx, chat: bool) -> tuple[str, str | None]:
    """Read the first event of a long stream, then close the connection (the server must abort it)."""
    body = good_body(ctx, chat, stream=True, max_tokens=4 * ctx.max_tokens)
    try:
        async with ctx.client.stream("POST", ctx.url + path_of(chat), json=body) as r:
            if r.status_code != 200:
                return "failed", f"status {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return "disconnected", None  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        return "lost", f"{type(exc).__name__} before the first event: {exc}"
    return "lost", "stream ended before its first event"


async def stop_waiting(ctx: Ctx, chat: bool) -> tuple[str, str | None]:
    """A non-streaming client that gives up after a moment (the server must notice and abort)."""
    body = good_body(ctx, chat, stream=False, max_tokens=4 * ctx.max_tokens)
    try:
        r = await ctx.client.post(ctx.url + path_of(chat), json=body, timeout=httpx.Timeout(10.0, read=0.3))
    except httpx.ReadTimeout:
        return "disconnected", None
    except httpx.HTTPError as exc:
        return "lost", f"{type(exc).__name__}: {exc}"
    return ("completed", None) if r.status_code == 200 else ("failed", f"status {r.status_code}: {r.text[:300]}")


def bad_requests(ctx: Ctx) -> list[tuple[str, bytes, set[int]]]:
    """(path, raw body, statuses that are right) for input the server must refuse."""
    chat = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": ctx.model, "prompt": "hi", "max_tokens": 4}
    dumps = lambda b: json.dumps(b).encode()  # noqa: E731
    return [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}', {400}),
        ("/v1/completions", b"not json at all", {400}),
        ("/v1/chat/completions", dumps({**chat, "temperature": 5}), {400}),
        ("/v1/chat/completions", dumps({**chat, "n": 17}), {400}),
        ("/v1/chat/completions", dumps({**chat, "messages": "hi"}), {400}),
        ("/v1/completions", dumps({**comp, "top_p": 0}), {400}),
        ("/v1/completions", dumps({**comp, "max_tokens": -1}), {400}),
        ("/v1/completions", dumps({**comp, "logprobs": 21}), {400}),
        ("/v1/completions", dumps({**comp, "prompt": [-1, 5]}), {400}),
        ("/v1/completions", dumps({**comp, "max_tokens": 10**7}), {400}),
        ("/v1/completions", dumps({**comp, "model": "no-such-model"}), {404}),
    ]


async def bad_input(ctx: Ctx) -> tuple[str, str | None]:
    path, raw, statuses = ctx.rng.choice(bad_requests(ctx))
    return await expect_refusal(ctx, path, raw, statuses)


async def oversized(ctx: Ctx) -> tuple[str, str | None]:
    """A body just over the limit: 413 from Content-Length (400 if the server's limit is larger)."""
    prompt = "x" * (ctx.body_limit + 1024)
    raw = json.dumps({"model": ctx.model, "prompt": prompt, "max_tokens": 1}).encode()
    return await expect_refusal(ctx, "/v1/completions", raw, {413, 400})


async def expect_refusal(ctx: Ctx, path: str, raw: bytes, statuses: set[int]) -> tuple[str, str | None]:
    headers = {"content-type": "application/json"}
    try:
        r = await ctx.client.post(ctx.url + path, content=raw, headers=headers)
    except httpx.HTTPError as exc:
        return "failed", f"{type(exc).__name__} on bad input to {path}: {exc}"
    if r.status_code in statuses and is_openai_error(r.content, r.status_code):
        return "rejected", None
    return "failed", f"bad input to {path} ({raw[:120]!r}): status {r.status_code}: {r.text[:300]}"


# (name, weight, scenario): mostly good traffic, a steady trickle of everything else.
SCENARIOS = [
    ("chat", 4, lambda ctx: plain(ctx, chat=True)),
    ("chat_stream", 4, lambda ctx: streamed(ctx, chat=True)),
    ("completion", 3, lambda ctx: plain(ctx, chat=False)),
    ("completion_stream", 3, lambda ctx: streamed(ctx, chat=False)),
    ("disconnect_mid_stream", 2, lambda ctx: leave_mid_stream(ctx, chat=ctx.rng.random() < 0.5)),
    ("disconnect_waiting", 1, lambda ctx: stop_waiting(ctx, chat=ctx.rng.random() < 0.5)),
    ("bad_input", 2, bad_input),
    ("oversized_body", 1, oversized),
]


# ------------------------------------------------------------------ processes and memory


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of pid, from /proc/*/stat (field 4 is the parent pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def listening_pid(port: int) -> int | None:
    """The process holding the listening socket on `port` (to find the api when given only a URL)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and any(link in inodes for link in fd_links(entry)):
            return int(entry.name)
    return None


def fd_links(proc: Path) -> list[str]:
    try:
        return [os.readlink(fd) for fd in (proc / "fd").iterdir()]
    except OSError:
        return []


def process_label(pid: int) -> str:
    """A name for a child of the api that is not a worker (multiprocessing's resource tracker, usually)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    return "resource_tracker" if b"resource_tracker" in cmdline else f"pid-{pid}"


def memory_snapshot(api_pid: int | None, workers: dict) -> dict:
    """RSS in MiB of the api, each worker, and any other process of the api's tree."""
    named = {int(pid): name for name, pid in workers.items() if pid}
    snapshot = {}
    if api_pid is not None:
        snapshot["api"] = rss_mib(api_pid)
        for child in children(api_pid):
            named.setdefault(child, process_label(child))
    for pid, name in named.items():
        snapshot[name] = rss_mib(pid)
    return snapshot


# ------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "foresight.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *serve_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log:
        # Its own session: stopping it can take the whole group, workers included.
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


async def wait_healthy(client: httpx.AsyncClient, url: str, timeout_s: float,
                       process: subprocess.Popen | None) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} while starting")
        try:
            r = await client.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"GET {url}/health did not answer 200 within {timeout_s:.0f} s")


def stop_server(process: subprocess.Popen, grace_s: float = 60.0) -> dict:
    """SIGTERM (the server drains and stops its workers), then SIGKILL for whatever is left."""
    start = time.monotonic()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    stopped_s = round(time.monotonic() - start, 2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(timeout=10)
    return {"exit_code": process.returncode, "sigterm_to_exit_s": stopped_s}


# ------------------------------------------------------------------ the run


async def client_loop(ctx: Ctx, tally: Tally, deadline: float, budget: list[int]) -> None:
    names = [s[0] for s in SCENARIOS]
    weights = [s[1] for s in SCENARIOS]
    runs = {s[0]: s[2] for s in SCENARIOS}
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        name = ctx.rng.choices(names, weights)[0]
        start = time.monotonic()
        category, detail = await runs[name](ctx)
        tally.record(name, category, time.monotonic() - start, detail)


async def sample_memory(api_pid, workers: dict, samples: list, every_s: float, t0: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        samples.append({"t_s": round(time.monotonic() - t0, 1), **memory_snapshot(api_pid, workers)})


async def metric_values(client: httpx.AsyncClient, url: str, names: tuple[str, ...]) -> dict:
    text = (await client.get(url + "/metrics", timeout=10)).text
    values = {}
    for line in text.splitlines():
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in names:
            values[metric] = values.get(metric, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float = 60.0) -> dict:
    """Once the clients stop, nothing may stay running or waiting (an abort that never happened would)."""
    names = ("foresight_requests_running", "foresight_requests_waiting")
    start = time.monotonic()
    values: dict = {}
    while time.monotonic() - start < timeout_s:
        try:
            values = await metric_values(client, url, names)
        except httpx.HTTPError as exc:
            values = {"error": str(exc)}
        if values and all(values.get(n, 0) == 0 for n in names):
            return {"idle": True, "after_s": round(time.monotonic() - start, 2), **values}
        await asyncio.sleep(0.5)
    return {"idle": False, "after_s": round(time.monotonic() - start, 2), **values}


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(url + "/v1/models", timeout=10)).json()["data"][0]["id"]


async def traffic(args, url: str, api_pid: int | None, client: httpx.AsyncClient) -> dict:
    health_start = await health(client, url)
    workers = health_start.get("workers", {})
    ctx_args = dict(client=client, url=url, model=await model_name(client, url), max_tokens=args.max_tokens,
                    body_limit=args.body_limit)
    t0 = time.monotonic()
    mem_start = memory_snapshot(api_pid, workers)
    samples: list = [{"t_s": 0.0, **mem_start}]
    sampler = asyncio.create_task(sample_memory(api_pid, workers, samples, args.sample_every, t0))
    tally, budget = Tally(), [args.max_requests]
    deadline = t0 + 60 * args.minutes
    loops = [client_loop(Ctx(rng=random.Random(args.seed * 1000 + i), **ctx_args), tally, deadline, budget)
             for i in range(args.concurrency)]
    await asyncio.gather(*loops)
    traffic_s = time.monotonic() - t0
    idle = await wait_idle(client, url)
    sampler.cancel()
    mem_end = memory_snapshot(api_pid, workers)
    health_end = await health(client, url)
    result = tally.to_dict()
    result.update(traffic_s=round(traffic_s, 1), after_traffic=idle,
                  health={"start": health_start, "end": health_end},
                  rss_mib={"start": mem_start, "end": mem_end, "samples": samples})
    return result


async def health(client: httpx.AsyncClient, url: str) -> dict:
    try:
        r = await client.get(url + "/health", timeout=10)
        return {**(r.json() if r.status_code == 200 else {}), "http_status": r.status_code}
    except httpx.HTTPError as exc:
        return {"http_status": None, "error": str(exc)}


def verdict(result: dict) -> bool:
    req = result["requests"]
    restarts = [result["health"][k].get("restarts") for k in ("start", "end")]
    return (req["failed"] == 0 and req["lost"] == 0 and result["after_traffic"]["idle"]
            and result["health"]["end"].get("http_status") == 200 and restarts[0] == restarts[1])


def summary(result: dict) -> str:
    req = result["requests"]
    lines = [f"soak: {result['traffic_s']:.0f} s of traffic, {req['sent']} requests: {req['completed']} completed, "
             f"{req['rejected']} rejected as expected, {req['disconnected']} disconnected on purpose, "
             f"{req['failed']} failed, {req['lost']} lost",
             f"idle after traffic: {result['after_traffic']['idle']} ({result['after_traffic']['after_s']} s); "
             f"worker restarts: {result['health']['start'].get('restarts')} -> "
             f"{result['health']['end'].get('restarts')}"]
    start, end = result["rss_mib"]["start"], result["rss_mib"]["end"]
    for name in start:
        lines.append(f"rss {name}: {start[name]} MiB -> {end.get(name)} MiB")
    for name, row in result["by_scenario"].items():
        lines.append(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    for ex in result["examples"][:5]:
        lines.append(f"  {ex['category']} {ex['scenario']}: {ex['detail'][:200]}")
    lines.append(f"verdict: {'OK' if result['ok'] else 'PROBLEMS'}")
    return "\n".join(lines)


async def run(args) -> dict:
    process, url = None, args.url
    log_path = Path(args.out).with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if url is None:
        process, url = start_server(log_path, args.serve_args)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    stopped, started = None, time.monotonic()
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            await wait_healthy(client, url, args.startup_timeout, process)
            startup_s = round(time.monotonic() - started, 1)
            api_pid = process.pid if process is not None else listening_pid(urlsplit(url).port or 80)
            result = await traffic(args, url, api_pid, client)
    finally:
        if process is not None:
            stopped = stop_server(process)
    result.update(config=run_config(args, url, process is not None), machine=machine(), server_stop=stopped,
                  server_startup_s=startup_s if process is not None else None,
                  server_log=str(log_path) if process is not None else None)
    # uvicorn re-raises a SIGTERM it handled once it has shut down: -15 is a clean stop too.
    clean_stop = stopped is None or stopped["exit_code"] in (0, -signal.SIGTERM)
    result["ok"] = verdict(result) and clean_stop
    return result


def run_config(args, url: str, started_server: bool) -> dict:
    return {"url": url, "started_server": started_server, "minutes": args.minutes, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "seed": args.seed, "max_requests": args.max_requests,
            "serve_args": args.serve_args}


def machine() -> dict:
    """What the numbers were measured on; the load average says whether anything else competed."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None)
    return {"cpus": os.cpu_count(), "cpu": cpu, "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def loopback_url(text: str) -> str:
    """Only 127.0.0.1: this tool floods what it points at."""
    parts = urlsplit(text)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError("the URL must be http://127.0.0.1:PORT")
    return text.rstrip("/")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError("must be > 0")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=positive(float), default=5.0, help="how long the traffic runs")
    p.add_argument("--url", type=loopback_url, default=None,
                   help="a running server, http://127.0.0.1:PORT (default: start `foresight serve` here)")
    p.add_argument("--concurrency", type=positive(int), default=4, help="clients at once (at most 64)")
    p.add_argument("--out", default="soak.json", help="the JSON report (the server log goes beside it)")
    p.add_argument("--max-requests", type=positive(int), default=100_000, help="stop after this many")
    p.add_argument("--max-tokens", type=positive(int), default=16, help="the most tokens a good request asks for")
    p.add_argument("--request-timeout", type=positive(float), default=300.0, help="seconds per read")
    p.add_argument("--startup-timeout", type=positive(float), default=900.0, help="seconds to wait for /health")
    p.add_argument("--sample-every", type=positive(float), default=10.0, help="seconds between RSS samples")
    p.add_argument("--body-limit", type=positive(int), default=DEFAULT_BODY_LIMIT,
                   help="the server's --max-request-bytes (the oversized body is 1 KiB more)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="after `--`: flags for the `foresight serve` it starts")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.concurrency > 64:
        print("soak: --concurrency is at most 64", file=sys.stderr)
        return 2
    if args.url is not None and args.serve_args:
        print("soak: serve flags apply only to a server it starts (no --url)", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(args))
    except RuntimeError as exc:  # the server did not start or answer
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(summary(result))
    print(f"report: {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
