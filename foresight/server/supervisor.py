"""Spawning, handshaking, watching and restarting the two worker processes (in the api process).

Start order: the drafter first (its ready message says which target hidden states it needs), then
the target (which is told those layers). If either dies, every in-flight request fails with 503,
the other is stopped too, and both are started again, up to `max_restarts` times.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.messages import WorkerReady

WORKERS = ("drafter", "target")
STOP_GRACE_S = 5.0


class WorkerStartError(RuntimeError):
    pass


@dataclass
class WorkerHandle:
    name: str
    process: mp.process.BaseProcess | None = None
    ready: WorkerReady | None = None
    ready_future: asyncio.Future | None = None

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


@dataclass
class Supervisor:
    cfg: EngineConfig
    addrs: WorkerAddresses
    startup_timeout_s: float = 600.0
    max_restarts: int = 5
    on_state_change: object = None  # callable(worker, up: bool) for metrics / health
    on_restart: object = None  # callable(worker) after a restart
    on_death: object = None  # async callable(worker, reason) to fail in-flight requests
    workers: dict = field(default_factory=lambda: {n: WorkerHandle(n) for n in WORKERS})
    restarts: int = 0
    healthy: bool = False
    _monitor: asyncio.Task | None = None
    _stopping: bool = False

    async def start(self) -> None:
        await self._start_pair()
        self._monitor = asyncio.create_task(self._watch())

    def on_ready(self, msg: WorkerReady) -> None:
        handle = self.workers.get(msg.worker)
        if handle is not None and handle.ready_future is not None and not handle.ready_future.done():
            handle.ready_future.set_result(msg)

    def worker_info(self, worker: str) -> dict:
        ready = self.workers[worker].ready
        return ready.info if ready else {}

    async def _start_pair(self) -> None:
        self.healthy = False
        drafter = await self._spawn("drafter", "foresight.drafter_worker.worker", (self.cfg.to_dict(), self.addrs.to_dict()))
        layers = list(drafter.info.get("hidden_layers", []))
        foresight = bool(drafter.info.get("supports_foresight", False))
        if self.cfg.mode == "pipelined" and not foresight:
            self._kill(self.workers["drafter"])
            raise WorkerStartError(f"mode pipelined needs a drafter that supports foresight; "
                                   f"{drafter.info.get('proposer')!r} does not (use --mode sync or ar)")
        await self._spawn("target", "foresight.target_worker.worker",
                          (self.cfg.to_dict(), self.addrs.to_dict(), layers, foresight))
        self.healthy = True

    async def _spawn(self, name: str, module: str, args: tuple) -> WorkerReady:
        handle = self.workers[name]
        handle.ready_future = asyncio.get_running_loop().create_future()
        ctx = mp.get_context("spawn")
        handle.process = ctx.Process(target=_run_worker, args=(module, args), name=f"foresight-{name}", daemon=True)
        handle.process.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not handle.ready_future.done():
            if not handle.process.is_alive():
                raise WorkerStartError(f"{name} worker exited during start-up (exit code {handle.process.exitcode})")
            if time.monotonic() > deadline:
                self._kill(handle)
                raise WorkerStartError(f"{name} worker not ready after {self.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        handle.ready = handle.ready_future.result()
        self._notify(name, True)
        return handle.ready

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.25)
            dead = [h.name for h in self.workers.values() if self.healthy and not h.alive()]
            if dead:
                await self.handle_death(dead[0], f"exit code {self.workers[dead[0]].process.exitcode}")

    async def handle_death(self, worker: str, reason: str) -> None:
        """A worker died (sentinel or its own WorkerDead message): fail requests, restart the pair."""
        if not self.healthy or self._stopping:
            return
        self.healthy = False
        self._notify(worker, False)
        if self.on_death is not None:
            await self.on_death(worker, reason)
        for handle in self.workers.values():
            self._kill(handle)
        if self.restarts >= self.max_restarts:
            return  # stay unhealthy: /health answers 503 and requests get 503
        self.restarts += 1
        try:
            await self._start_pair()
        except WorkerStartError:
            self.healthy = False
            return
        if self.on_restart is not None:
            self.on_restart(worker)

    def _notify(self, worker: str, up: bool) -> None:
        if self.on_state_change is not None:
            self.on_state_change(worker, up)

    def _kill(self, handle: WorkerHandle) -> None:
        proc = handle.process
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_GRACE_S)
        handle.ready = None

    async def stop(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for name in ("target", "drafter"):
            self._kill(self.workers[name])


def _run_worker(module: str, args: tuple) -> None:
    import importlib

    from ..protocol.liveness import exit_with_parent

    exit_with_parent()
    importlib.import_module(module).main(*args)
