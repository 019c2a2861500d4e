"""`foresight bench --concurrency 1,4,8,16`: streaming clients against a real `foresight serve`.

For each mode in --modes a server subprocess is started with the bench's engine flags and `--mode <mode>`
(the OpenAI API has no per-request mode: a mode is a server setting), fresh for each repeat (below).
After each answers /health with 200 and one warm-up request, every concurrency level L is run against the
modes in turn: L clients take requests from one shared list (the prompts, cycled) until the level's requests
are spent; every request streams with usage. With --load-repeats R each level runs R times per mode, the
modes' order rotated each time, so that drift on a shared machine (other tenants, heat) falls on every mode
alike and the ratios against `ar` compare runs made minutes apart, not a whole bench apart.
Per level and mode: aggregate output tokens/s over the level's wall time (the median of the repeats, every
repeat kept), TTFT, inter-chunk latency (ITL) and TPOT percentiles (as vLLM's benchmark_serving), and the
count of answered, rejected (429) and failed requests; per level, each mode's tokens/s over `ar`'s in the
same repeat (`ratios_vs_ar`).
With --peers llamacpp, llama.cpp's own HTTP server (bench/llamacpp_load.py: the GGUF as shipped and as BF16,
at the workers' total threads, as many slots as the highest level) runs every level too, by the same
clients, in the same rotation as the modes: its rows (`llamacpp@Nt`, `llamacpp-bf16@Nt`) sit beside the
modes' in each level, and `ratios_vs_ar` gives its tokens/s over `ar`'s as for a mode; `settings.peers`
says how each ran. A peer's row has no `strategy_rounds` or `compiled_rounds` (the share of rounds a compiled
graph verified).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from ..config import API_KEY_ENV, ConfigError, EngineConfig, add_engine_args
from ..protocol.kinds import Mode
from .prompts import load_prompts, request_fields

SERVER_MODULE = "foresight.cli"
HEALTH_TIMEOUT_S = 1200.0  # model loading on a slow machine, compiling the target's steps at a first start
STOP_GRACE_S = 40.0  # SIGTERM drains (--drain-timeout, 30 s by default), then the process group is killed
REQUEST_TIMEOUT_S = 600.0  # longest wait for one read (the next chunk) of a request
MAX_ERROR_EXAMPLES = 3


# ---------------------------------------------------------------------------------------------- pure parts


def parse_levels(text: str) -> list[int]:
    """'1,4,8,16' -> [1, 4, 8, 16] (order kept, duplicates dropped)."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            level = int(part)
        except ValueError:
            raise ConfigError(f"concurrency: {part!r} is not a whole number") from None
        if level < 1:
            raise ConfigError("concurrency levels must be >= 1")
        if level not in levels:
            levels.append(level)
    if not levels:
        raise ConfigError("concurrency: give at least one level, e.g. 1,4,8,16")
    return levels


def requests_per_level(level: int, n_prompts: int, load_requests: int | None) -> int:
    """--load-requests if given, else enough to keep every client busy twice and use every prompt once."""
    if load_requests is not None:
        return load_requests
    return max(2 * level, n_prompts)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default, as vLLM reports); None if empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds; chunk times are absolute (perf_counter)."""

    status: str  # "ok" | "rejected" (HTTP 429) | "error"
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    end: float = 0.0  # arrival of the last event of the stream
    output_tokens: int = 0  # the usage's completion_tokens (else one per content chunk)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (tokens - 1): time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)


def summarise_level(results: list[RequestResult], wall_s: float) -> dict:
    """The report fields of one (level, mode): percentiles over the answered requests (ITL over all their
    chunk gaps pooled), tokens/s = their output tokens over the level's wall time."""
    ok = [r for r in results if r.status == "ok"]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    examples = [r.error for r in results if r.status != "ok" and r.error][:MAX_ERROR_EXAMPLES]
    return {
        "requests": len(results),
        "ok": len(ok),
        "rejected": sum(r.status == "rejected" for r in results),
        "errors": sum(r.status == "error" for r in results),
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": tokens / wall_s if wall_s > 0 and ok else None,
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p90": _ms(percentile(ttft, 90)),
        "itl_ms_p50": _ms(percentile(itl, 50)),
        "itl_ms_p90": _ms(percentile(itl, 90)),
        "tpot_ms_p50": _ms(percentile(tpot, 50)),
        "latency_ms_p50": _ms(percentile([r.latency for r in ok], 50)),
        "error_examples": examples,
    }


def run_order(modes: list[str], repeat: int) -> list[str]:
    """The modes' order in repeat `repeat` (from 0): rotated by one place per repeat, so that over len(modes)
    repeats each mode runs once in each place."""
    k = repeat % len(modes)
    return modes[k:] + modes[:k]


def merge_runs(runs: list[tuple[list[RequestResult], float]]) -> dict:
    """The report fields of one (level, mode) over its repeats, each (results, wall_s): percentiles over all
    repeats' requests pooled; tokens/s the median of the repeats' own figures, which are kept as
    `tokens_per_s_runs`."""
    fields = summarise_level([r for results, _ in runs for r in results], sum(wall_s for _, wall_s in runs))
    rates = [summarise_level(results, wall_s)["tokens_per_s"] for results, wall_s in runs]
    known = [x for x in rates if x is not None]
    fields["tokens_per_s"] = median(known) if known else None
    fields["tokens_per_s_runs"] = [None if x is None else round(x, 3) for x in rates]
    return fields


def ratios_vs_ar(section: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Per level and mode: its tokens/s over `ar`'s in each repeat (runs of one repeat are minutes apart), and
    the median of those ratios. Empty without mode `ar`."""
    out: dict[str, dict[str, dict]] = {}
    for level, modes in section.items():
        ar_runs = modes.get(Mode.AR.value, {}).get("tokens_per_s_runs")
        if not ar_runs:
            continue
        for mode, fields in modes.items():
            pairs = zip(fields["tokens_per_s_runs"], ar_runs)
            runs = [round(x / a, 4) for x, a in pairs if x is not None and a]
            if mode != Mode.AR.value and runs:
                out.setdefault(level, {})[mode] = {"median": median(runs), "runs": runs}
    return out


def parse_event(data: str) -> tuple[str, int | None, str | None]:
    """One SSE `data:` payload of /v1/completions or /v1/chat/completions -> (content, completion tokens
    from the usage if it carries one, error message if it is an error event)."""
    event = json.loads(data)
    if "error" in event:
        err = event["error"]
        return "", None, (err.get("message") if isinstance(err, dict) else None) or str(err)
    text = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
    usage = event.get("usage") or {}
    return text, usage.get("completion_tokens"), None


def request_body(item: dict, index: int, args: argparse.Namespace) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request for a prompt item ({'prompt'} or {'messages'})."""
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed + index,
            **request_fields(getattr(args, "request_fields", "")), "stream": True,
            "stream_options": {"include_usage": True}}
    if "messages" in item:
        return "/v1/chat/completions", {**body, "messages": item["messages"]}
    return "/v1/completions", {**body, "prompt": item["prompt"]}


def serve_argv(cfg: EngineConfig, mode: str, port: int, extra: list[str]) -> list[str]:
    """`foresight serve` with every engine flag the bench got (read back from the parser's own flag names,
    so new flags carry over), then --load-server-args, then this mode, host and port."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv = [sys.executable, "-m", SERVER_MODULE, "serve"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("mode", "help") or not hasattr(cfg, action.dest):
            continue
        value = getattr(cfg, action.dest)
        if value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv + list(extra) + ["--mode", mode, "--host", "127.0.0.1", "--port", str(port)]


# ---------------------------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop_server(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (the server drains and stops its workers), then SIGKILL to its whole process group."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # workers included (its own session)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


class ServerURL(str):
    """A running server's base URL, with its process attached (the bench of replicas kills one)."""

    process: subprocess.Popen

    def __new__(cls, base: str, process: subprocess.Popen) -> "ServerURL":
        self = super().__new__(cls, base)
        self.process = process
        return self


@contextlib.asynccontextmanager
async def running_server(cfg: EngineConfig, mode: str, log_path: Path, extra: list[str], client):
    """Start `foresight serve --mode <mode>`, wait for /health 200, yield its base URL (a `ServerURL`); always
    stop it."""
    port = _free_port()
    cmd = serve_argv(cfg, mode, port, extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[2])  # the server imports this very package
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[load] {mode}: starting {shlex.join(cmd[1:])} (log {log_path})", flush=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise ConfigError(f"the server for mode {mode} exited with code {process.returncode} before "
                                  f"/health answered 200; its log ({log_path}) ends:\n{_log_tail(log_path)}")
            with contextlib.suppress(Exception):
                if (await client.get(f"{base}/health", timeout=5)).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise ConfigError(f"the server for mode {mode} did not answer 200 on /health within "
                                  f"{HEALTH_TIMEOUT_S:.0f} s; its log ({log_path}) ends:\n{_log_tail(log_path)}")
            await asyncio.sleep(0.5)
        yield ServerURL(base, process)
    finally:
        await asyncio.to_thread(stop_server, process)


# ---------------------------------------------------------------------------------------------- the clients


async def one_request(client, base: str, path: str, body: dict, headers: dict) -> RequestResult:
    """One streamed request; never raises (a failure is a result with status error or rejected)."""
    result = RequestResult("error", start=time.perf_counter())
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", base + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                result.status = "rejected" if resp.status_code == 429 else "error"
                result.error = f"HTTP {resp.status_code}: {text}"
                result.end = time.perf_counter()
                return result
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                data = line[len("data:"):].strip()
                result.end = now
                if data == "[DONE]":
                    done = True
                    break
                content, tokens, error = parse_event(data)
                if error is not None:
                    result.error = f"error event: {error}"
                    return result
                if content:
                    result.chunk_times.append(now)
                    chunks += 1
                if tokens is not None:
                    usage_tokens = tokens
            if not done:
                result.error = "the stream ended without [DONE]"
                return result
    except Exception as exc:  # a transport failure, a malformed event: counted, never fatal
        result.end = time.perf_counter()
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.status = "ok"
    return result


# Round counters of the server's /metrics: per strategy (what auto and the load policy chose) and per forward
# (a compiled graph or eager), as {(counter, label value): rounds}
_ROUND_COUNTERS = {"strategy": re.compile(r'^foresight_strategy_rounds_total\{[^}]*strategy="([^"]+)"[^}]*\}\s+'
                                          r'([0-9.eE+-]+)$', re.MULTILINE),
                   "forward": re.compile(r'^foresight_rounds_by_forward_total\{[^}]*forward="([^"]+)"[^}]*\}\s+'
                                         r'([0-9.eE+-]+)$', re.MULTILINE)}


async def round_counts(client, base: str) -> dict[tuple[str, str], float]:
    """Rounds run so far per strategy and per forward, from the server's /metrics."""
    text = (await client.get(f"{base}/metrics", timeout=10)).text
    out: dict[tuple[str, str], float] = {}
    for counter, pattern in _ROUND_COUNTERS.items():
        for label, value in pattern.findall(text):
            out[counter, label] = out.get((counter, label), 0.0) + float(value)
    return out


def round_fields(counts: dict[tuple[str, str], float]) -> dict:
    """A level's `strategy_rounds` (rounds per strategy that ran) and `compiled_rounds` (the share a compiled graph
    verified; None without compiled steps) from the rounds counted meanwhile."""
    forwards = {label: n for (counter, label), n in counts.items() if counter == "forward"}
    total = sum(forwards.values())
    return {"strategy_rounds": {s: int(n) for (counter, s), n in sorted(counts.items())
                                if counter == "strategy" and n > 0},
            "compiled_rounds": round(forwards.get("compiled", 0.0) / total, 4) if total else None}


async def run_level(client, base: str, items: list[dict], level: int, n_requests: int,
                    args: argparse.Namespace, headers: dict,
                    make_body=request_body) -> tuple[list[RequestResult], float]:
    """`level` clients take requests 0..n_requests-1 (prompt i % len(items)) from one shared counter;
    `make_body` makes each (path, body) (a peer's differs: llamacpp_load.LoadPeers.body)."""
    results: list[RequestResult] = []
    next_index = iter(range(n_requests))

    async def client_loop():
        for i in next_index:  # shared iterator: each request goes to whichever client is free
            path, body = make_body(items[i % len(items)], i % len(items), args)
            results.append(await one_request(client, base, path, body, headers))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(level, n_requests))))
    return results, time.perf_counter() - t0


async def counted_run(client, base: str, items: list[dict], level: int, n_requests: int, args: argparse.Namespace,
                      headers: dict) -> tuple[tuple[list[RequestResult], float], dict[tuple[str, str], float]]:
    """`run_level`, and the rounds per strategy and per forward the server ran meanwhile (from its /metrics)."""
    before = await round_counts(client, base)
    run = await run_level(client, base, items, level, n_requests, args, headers)
    after = await round_counts(client, base)
    return run, {key: n - before.get(key, 0.0) for key, n in after.items()}


def run_line(results: list[RequestResult], wall_s: float) -> str:
    """One run's figures, for the progress log."""
    f = summarise_level(results, wall_s)
    return (f"{f['ok']}/{f['requests']} ok, {f['rejected']} rejected, {f['errors']} errors, "
            f"{f['tokens_per_s'] or 0:.1f} tok/s, TTFT p50 {f['ttft_ms_p50']} ms, ITL p50 {f['itl_ms_p50']} ms")


def _auth_headers() -> dict:
    key = os.environ.get(API_KEY_ENV)  # the server subprocess inherits it and then requires it
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_log_path(out: Path, mode: str, repeat: int) -> Path:
    """Where the server of `mode` in repeat `repeat` (from 0) logs: `<out stem>.server-<mode>.log`, with
    `-r<n>` for the later repeats' fresh servers."""
    suffix = f"-r{repeat + 1}" if repeat else ""
    return out.with_name(f"{out.stem}.server-{mode}{suffix}.log")


@contextlib.asynccontextmanager
async def mode_servers(cfg: EngineConfig, modes: list[str], out: Path, extra: list[str], client, repeat: int,
                       warm_up: dict, args: argparse.Namespace, headers: dict):
    """One fresh server per mode (each its own --mode), all up for one repeat, each sent one warm-up request
    (prompt item `warm_up`); yields their base URLs; always stops them.
    Fresh per repeat: a server keeps its speed for its lifetime, and instances of one build differed by up to
    7 % (docs/journal/2026-12-04-fresh-servers.md), which servers kept for the whole bench would have made a fixed
    bias of a mode."""
    async with contextlib.AsyncExitStack() as stack:
        bases = {}
        for mode in modes:
            log_path = server_log_path(out, mode, repeat)
            bases[mode] = await stack.enter_async_context(running_server(cfg, mode, log_path, extra, client))
            path, body = request_body(warm_up, 0, args)
            warm = await one_request(client, bases[mode], path, body, headers)
            if warm.status != "ok":
                print(f"[load] {mode}: the warm-up request failed: {warm.error}", flush=True)
        yield bases


def load_peers(args: argparse.Namespace, cfg: EngineConfig, items: list[dict], levels: list[int]):
    """The --peers to run under load (bench/llamacpp_load.py, imported here: it imports this module); an
    empty LoadPeers without --peers."""
    from .llamacpp_load import LoadPeers, plan_load_peers

    planned = plan_load_peers(getattr(args, "peers", "") or "", cfg)
    return LoadPeers(cfg, planned, items, max(levels), args)


async def load_bench(args: argparse.Namespace, cfg: EngineConfig) -> dict:
    try:
        import httpx
    except ImportError:
        raise ConfigError("the load benchmark (--concurrency) needs httpx: pip install httpx") from None
    from .harness import machine_info

    levels = parse_levels(args.concurrency)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in Mode.values()]
    if bad or not modes:
        raise ConfigError(f"modes: unknown or no mode(s) {bad}; choose from {', '.join(Mode.values())}")
    if args.load_requests is not None and args.load_requests < 1:
        raise ConfigError("load_requests must be >= 1")
    repeats = args.load_repeats
    if repeats < 1:
        raise ConfigError("load_repeats must be >= 1")
    items = load_prompts(args.prompts, args.limit)
    if not items:
        raise ConfigError("prompts: no prompts to send")
    extra = shlex.split(args.load_server_args)
    n_per_level = {level: requests_per_level(level, len(items), args.load_requests) for level in levels}
    headers = _auth_headers()
    peers = load_peers(args, cfg, items, levels)
    names = modes + peers.names  # run in one rotation
    out = Path(args.out)
    section: dict[str, dict[str, dict]] = {str(level): {} for level in levels}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    runs: dict[tuple[int, str], list] = {(level, name): [] for level in levels for name in names}
    rounds: dict[tuple[int, str], Counter] = {key: Counter() for key in runs}
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for repeat in range(repeats):
            async with (mode_servers(cfg, modes, out, extra, client, repeat, items[0], args, headers) as bases,
                        peers.serving(client, 0, args, headers) as peer_bases):
                for level in levels:
                    for mode in run_order(names, repeat):
                        if mode in peer_bases:  # llama.cpp: its own bodies, no /metrics of rounds
                            run, ran = await run_level(client, peer_bases[mode], items, level, n_per_level[level],
                                                       args, headers, peers.body), {}
                        else:
                            run, ran = await counted_run(client, bases[mode], items, level, n_per_level[level],
                                                         args, headers)
                        runs[level, mode].append(run)
                        rounds[level, mode].update(ran)
                        print(f"[load] {mode} @ {level} (run {repeat + 1}/{repeats}): {run_line(*run)}", flush=True)
    for level in levels:
        for mode in names:
            fields = merge_runs(runs[level, mode])
            if mode in modes:
                fields.update(round_fields(rounds[level, mode]))
            section[str(level)][mode] = fields
            ran = f", rounds {fields['strategy_rounds']}" if mode in modes else ""
            print(f"[load] {mode} @ {level}: median {fields['tokens_per_s'] or 0:.1f} tok/s over "
                  f"{fields['tokens_per_s_runs']}{ran}", flush=True)
    return {
        "model": str(cfg.target or "SmolLM2-135M-Instruct (embedded default)"),
        "drafter": cfg.drafter,
        "machine": machine_info(cfg),
        "settings": {"prompts": args.prompts, "n_prompts": len(items), "temperature": args.temperature,
                     "max_tokens": args.max_tokens, "block_size": cfg.block_size, "verification": cfg.verification,
                     "modes": modes, "seed": args.seed, "concurrency": levels, "repeats": repeats,
                     "servers": "one per mode, fresh for each repeat",
                     "requests_per_level": {str(k): v for k, v in n_per_level.items()},
                     "server_args": extra, "batched_steps": cfg.batched_steps,
                     "max_num_batched_tokens": cfg.max_num_batched_tokens, "peers": peers.info()},
        "concurrency": section,
        "ratios_vs_ar": ratios_vs_ar(section),
    }
