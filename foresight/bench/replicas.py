"""Replicas behind the repository's HAProxy config, on one machine (deploy/haproxy/haproxy.cfg; docs/deploy.md).

The config is written for compose: it listens on :8000 and :8404 and finds the replicas through compose's DNS
(`server-template ... foresight-replica:8000`). `loopback_config` points exactly those three lines at loopback
ports and keeps every other line (balancing, health checks, retries, timeouts) as deployed; `Balancer` runs
`haproxy` on it and reads each replica's state from the stats page.

    python -m foresight.bench.replicas --out docs/results/replicas/replicas.json [--clients 8] [engine flags]

measures, with two `foresight serve` replicas on this machine: 8 streaming clients straight to one replica,
through the balancer to that replica alone (the balancer's own overhead), through the balancer to both, and a
failover (one replica SIGKILLed mid-load: failed requests, and the longest pause in the token streams).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
API_BIND = re.compile(r"^(\s*)bind :8000\s*$", re.M)
STATS_BIND = re.compile(r"^(\s*)bind :8404\s*$", re.M)
REPLICAS = re.compile(r"^(\s*)server-template replica .*$", re.M)


def loopback_config(text: str, replica_ports: list[int], api_port: int, stats_port: int) -> str:
    """The deployed config with its listeners on 127.0.0.1 and one `server` line per replica port."""
    for pattern, what in ((API_BIND, "bind :8000"), (STATS_BIND, "bind :8404"), (REPLICAS, "server-template")):
        if len(pattern.findall(text)) != 1:
            raise ValueError(f"the balancer config has no single `{what}` line to point at loopback")
    text = API_BIND.sub(rf"\1bind 127.0.0.1:{api_port}", text)
    text = STATS_BIND.sub(rf"\1bind 127.0.0.1:{stats_port}", text)
    servers = "\n".join(f"    server replica{i + 1} 127.0.0.1:{port}" for i, port in enumerate(replica_ports))
    return REPLICAS.sub(lambda _: servers, text)


@dataclass(slots=True)
class ReplicaState:
    """One backend server's row of the stats page."""

    status: str  # UP | DOWN | MAINT | "UP 1/2" while rising ...
    sessions: int  # requests (sessions) sent to it in all
    retries: int  # connection attempts retried (wretr)
    redispatched: int  # requests moved to another server after a failure (wredis)
    responses_5xx: int


class Balancer:
    """`haproxy` running the loopback version of the deployed config."""

    def __init__(self, replica_ports: list[int], api_port: int, stats_port: int, workdir: Path):
        self.api_url = f"http://127.0.0.1:{api_port}"
        self.stats_url = f"http://127.0.0.1:{stats_port}/stats;csv"
        self.config_path = Path(workdir) / "haproxy.cfg"
        self.config_path.write_text(loopback_config(HAPROXY_CFG.read_text(), replica_ports, api_port, stats_port))
        self.log_path = Path(workdir) / "haproxy.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> "Balancer":
        exe = shutil.which("haproxy")
        if exe is None:
            raise FileNotFoundError("`haproxy` is not on PATH (apt-get install -y --no-install-recommends haproxy)")
        with open(self.log_path, "wb") as log:  # -db: stay in the foreground, log to stdout
            self.process = subprocess.Popen([exe, "-db", "-f", str(self.config_path)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                self.replicas()
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start:\n{self.log_path.read_text(errors='replace')}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def replicas(self) -> dict[str, ReplicaState]:
        """The backend's servers by name, as the stats page shows them now."""
        with urllib.request.urlopen(self.stats_url, timeout=5) as resp:
            text = resp.read().decode().lstrip("# ")
        rows = [r for r in csv.DictReader(io.StringIO(text)) if r["pxname"] == "replicas" and r["svname"].startswith("replica")]
        return {r["svname"]: ReplicaState(r["status"], int(r["stot"] or 0), int(r["wretr"] or 0),
                                          int(r["wredis"] or 0), int(r["hrsp_5xx"] or 0)) for r in rows}

    def wait_for(self, name: str, status: str, timeout_s: float = 30.0) -> float:
        """Seconds until replica `name` shows `status` (UP or DOWN); raises after `timeout_s`."""
        t0 = time.monotonic()
        while self.replicas()[name].status.split()[0] != status:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{name} is {self.replicas()[name].status}, not {status}, after {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - t0


@contextlib.contextmanager
def running_balancer(replica_ports: list[int], api_port: int, stats_port: int, workdir: Path | None = None):
    with tempfile.TemporaryDirectory() as tmp:
        balancer = Balancer(replica_ports, api_port, stats_port, Path(workdir or tmp)).start()
        try:
            yield balancer
        finally:
            balancer.stop()


# ---------------------------------------------------------------------------------------------- the measurement


def longest_pause(results, since: float) -> float:
    """The longest time after `since` (perf_counter) in which no stream of `results` received a token."""
    times = sorted(t for r in results for t in r.chunk_times if t >= since)
    marks = [since] + times
    return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


async def measure(args) -> dict:
    import asyncio
    import os
    import signal

    import httpx

    from ..config import engine_from_args
    from .load import _auth_headers, _free_port, run_level, run_line, running_server, summarise_level
    from .prompts import load_prompts

    cfg = engine_from_args(args)
    out = Path(args.out)
    items = load_prompts(args.prompts, args.limit)
    headers = _auth_headers()
    report: dict = {"settings": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool))},
                    "runs": {}}

    async def level(name: str, base: str) -> None:
        results, wall = await run_level(client, base, items, args.clients, args.requests, args, headers)
        report["runs"][name] = summarise_level(results, wall)
        print(f"[replicas] {name}: {run_line(results, wall)}", flush=True)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        async with running_server(cfg, cfg.mode, out.with_name(out.stem + ".replica1.log"), [], client) as a, \
                running_server(cfg, cfg.mode, out.with_name(out.stem + ".replica2.log"), [], client) as b:
            ports = [int(a.rsplit(":", 1)[1]), int(b.rsplit(":", 1)[1])]
            await level("warm-up", a)  # first-use costs out of the measured runs
            await level("direct-1", a)
            with running_balancer(ports[:1], _free_port(), _free_port()) as one:
                await level("balancer-1", one.api_url)
            with running_balancer(ports, _free_port(), _free_port()) as both:
                await level("balancer-2", both.api_url)
                run = asyncio.create_task(run_level(client, both.api_url, items, args.clients, args.requests, args,
                                                    headers))
                await asyncio.sleep(args.kill_after)
                killed_at = time.perf_counter()
                os.killpg(b.process.pid, signal.SIGKILL)
                # watched from the kill on: how long the balancer goes on counting the dead replica as up
                marked_down = asyncio.create_task(asyncio.to_thread(both.wait_for, "replica2", "DOWN", 30.0))
                results, wall = await run
                failed_late = [r for r in results if r.status != "ok" and r.start > killed_at]
                summary = summarise_level(results, wall)
                summary.update(failover_pause_s=round(longest_pause(results, killed_at), 3),
                               failed_in_flight=sum(r.status != "ok" and r.start <= killed_at for r in results),
                               failed_after_kill=len(failed_late),
                               failed_after_kill_started_s=[round(r.start - killed_at, 3) for r in failed_late],
                               errors_seen=sorted({(r.error or "")[:120] for r in results if r.status != "ok"}),
                               marked_down_after_s=round(await marked_down, 3))
                report["runs"]["failover"] = summary
                print(f"[replicas] failover: {run_line(results, wall)}; pause {summary['failover_pause_s']} s",
                      flush=True)
    runs = report["runs"]
    report["ratios"] = {"balancer-1 / direct-1": runs["balancer-1"]["tokens_per_s"] / runs["direct-1"]["tokens_per_s"],
                        "balancer-2 / direct-1": runs["balancer-2"]["tokens_per_s"] / runs["direct-1"]["tokens_per_s"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse
    import asyncio

    from ..config import add_engine_args

    parser = argparse.ArgumentParser(prog="python -m foresight.bench.replicas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompts", default="chat")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--kill-after", type=float, default=8.0, help="seconds into the failover run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args))["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
