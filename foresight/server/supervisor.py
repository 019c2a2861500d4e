"""Spawning, handshaking, watching and restarting the two worker processes (in the api process).

Start order: the drafter first (its ready message says which target hidden states it needs), then
the target (which is told those layers). A worker is at fault when its process ends or its heartbeats
stop for `heartbeat_timeout_s` (stopped, frozen) or report a loop that has not turned for `stall_timeout_s`
(stuck in one step):

* drafter: it is killed, the target is told to go on without drafts (`DrafterStatus`), and a new
  drafter is started in the background; service never stops, it only loses speculation for a while.
* target: its in-flight requests fail with 503, both workers are killed (the drafter's contexts
  belong to the dead target's requests) and the pair is started again.

Each worker may be restarted `max_restarts` times within `restart_window_s`; past that the supervisor
calls `on_fatal` (the api then drains and exits non-zero, for its orchestrator to restart it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.kinds import Mode
from ..protocol.messages import Heartbeat, HiddenLayout, WorkerReady
from ..protocol.transport import sweep_shm
from .faults import HeartbeatMonitor, RestartBudget

log = logging.getLogger("foresight.supervisor")

WORKERS = ("drafter", "target")
MODULES = {"drafter": "foresight.drafter_worker.worker", "target": "foresight.target_worker.worker"}
STOP_GRACE_S = 5.0  # a stopping worker gets this long to leave by itself before SIGKILL
WATCH_PERIOD_S = 0.25
RETRY_DELAY_S = 1.0  # between failed starts, so a broken start does not spin

# Worker states, as /health reports them.
UP, STARTING, RESTARTING, DOWN, FAILED = "up", "starting", "restarting", "down", "failed"


class WorkerStartError(RuntimeError):
    pass


@dataclass
class WorkerHandle:
    name: str
    process: mp.process.BaseProcess | None = None
    ready: WorkerReady | None = None
    ready_future: asyncio.Future | None = None
    state: str = DOWN
    restarts: int = 0
    last_fault: str | None = None

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready else None


@dataclass
class Hooks:
    """What the supervisor tells the rest of the api (all optional)."""

    state_changed: Callable[[str, bool], None] | None = None  # (worker, up): metrics
    restarted: Callable[[str], None] | None = None  # (worker) after a successful restart: metrics
    target_lost: Callable[[str], Awaitable[None]] | None = None  # (reason): fail in-flight requests
    drafter_status: Callable[[bool, str], Awaitable[None]] | None = None  # (up, reason): tell the target
    fatal: Callable[[str], None] | None = None  # (reason): restart budget spent


@dataclass
class Supervisor:
    cfg: EngineConfig
    addrs: WorkerAddresses
    startup_timeout_s: float = 900.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    heartbeat_timeout_s: float = 5.0
    stall_timeout_s: float = 300.0
    hooks: Hooks = field(default_factory=Hooks)
    workers: dict = field(default_factory=lambda: {n: WorkerHandle(n) for n in WORKERS})
    _monitor: asyncio.Task | None = None
    _drafter_restart: asyncio.Task | None = None
    _stopping: bool = False

    def __post_init__(self) -> None:
        self.heartbeats = HeartbeatMonitor(self.heartbeat_timeout_s, self.stall_timeout_s)
        self.budgets = {n: RestartBudget(self.max_restarts, self.restart_window_s) for n in WORKERS}
        self._fault_lock = asyncio.Lock()  # one fault at a time: a target fault replaces the drafter too
        self._pair_drafter: WorkerReady | None = None  # the drafter the running target was started with
        self._started = False

    # ------------------------------------------------------------------ state

    @property
    def healthy(self) -> bool:
        """The target serves (with or without the drafter)."""
        return self.workers["target"].state == UP

    @property
    def target_started(self) -> bool:
        """The target has said it is ready (it listens for messages), whatever happened since."""
        return self.workers["target"].ready is not None

    @property
    def degraded(self) -> bool:
        return self.healthy and self.workers["drafter"].state != UP

    @property
    def restarts(self) -> int:
        return sum(h.restarts for h in self.workers.values())

    def worker_info(self, worker: str) -> dict:
        ready = self.workers[worker].ready
        return ready.info if ready else {}

    def report(self) -> dict:
        """Per worker: state, pid, restarts, last fault (for /health)."""
        return {h.name: {"state": h.state, "pid": h.pid, "restarts": h.restarts, "last_fault": h.last_fault}
                for h in self.workers.values()}

    def _set_state(self, worker: str, state: str) -> None:
        handle = self.workers[worker]
        was_up, handle.state = handle.state == UP, state
        if was_up != (state == UP) and self.hooks.state_changed is not None:
            self.hooks.state_changed(worker, state == UP)

    # ------------------------------------------------------------------ messages from workers

    def on_ready(self, msg: WorkerReady) -> None:
        handle = self.workers.get(msg.worker)
        if handle is not None and handle.ready_future is not None and not handle.ready_future.done():
            handle.ready_future.set_result(msg)

    def on_heartbeat(self, msg: Heartbeat) -> None:
        handle = self.workers.get(msg.worker)
        if handle is not None and handle.pid == msg.pid:  # not a late beat of a killed incarnation
            self.heartbeats.beat(msg.worker, msg.stalled_s)

    # ------------------------------------------------------------------ starting

    async def start(self) -> None:
        await self._start_pair()
        self._started = True
        self._monitor = asyncio.create_task(self._watch(), name="foresight-supervisor")

    async def _start_pair(self) -> None:
        drafter = await self._spawn("drafter", (self.cfg.to_dict(), self.addrs.to_dict()))
        self._check_drafter(drafter)
        self._pair_drafter = drafter
        layout, strategies, auto_strategies = _pairing(drafter)
        await self._spawn("target", (self.cfg.to_dict(), self.addrs.to_dict(), dataclasses.asdict(layout),
                                     list(strategies), list(auto_strategies)))

    def _check_drafter(self, drafter: WorkerReady) -> None:
        if self.cfg.mode != Mode.AUTO and self.cfg.mode not in drafter.info["strategies"]:
            raise WorkerStartError(f"mode {self.cfg.mode} is not offered by the drafter "
                                   f"{drafter.info.get('proposer')!r} (it offers auto, "
                                   f"{', '.join(drafter.info['strategies'])})")

    async def _start_drafter_alone(self) -> None:
        """A new drafter beside the running target; it must want what the target was started with."""
        drafter = await self._spawn("drafter", (self.cfg.to_dict(), self.addrs.to_dict()))
        got, wanted = _pairing(drafter), _pairing(self._pair_drafter)
        if got != wanted:
            await self._kill(self.workers["drafter"])
            raise WorkerStartError(f"the restarted drafter differs from the one the target was started with "
                                   f"(layout, strategies, auto strategies: {got} vs {wanted})")

    async def _spawn(self, name: str, args: tuple) -> WorkerReady:
        handle = self.workers[name]
        handle.ready_future = asyncio.get_running_loop().create_future()
        handle.ready = None
        self._set_state(name, RESTARTING if self._started else STARTING)
        ctx = mp.get_context("spawn")
        handle.process = ctx.Process(target=_run_worker, args=(MODULES[name], args), name=f"foresight-{name}",
                                     daemon=True)
        handle.process.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not handle.ready_future.done():
            if not handle.process.is_alive():
                raise WorkerStartError(f"{name} worker exited during start-up (exit code {handle.process.exitcode})")
            if time.monotonic() > deadline:
                await self._kill(handle)
                raise WorkerStartError(f"{name} worker not ready after {self.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        handle.ready = handle.ready_future.result()
        self.heartbeats.watch(name)
        self._set_state(name, UP)
        return handle.ready

    # ------------------------------------------------------------------ watching

    async def _watch(self) -> None:
        while not self._stopping:
            t0 = time.monotonic()
            await asyncio.sleep(WATCH_PERIOD_S)
            if time.monotonic() - t0 > WATCH_PERIOD_S + 1.0:
                # The api's own loop stalled: heartbeats may sit unread in the socket. Judge silence
                # only after the reader has had its turn.
                log.warning("the api event loop stalled for %.1f s", time.monotonic() - t0 - WATCH_PERIOD_S)
                continue
            try:
                await self._check()
            except Exception:  # the watch must outlive any one fault's handling
                log.exception("handling a worker fault failed")

    async def _check(self) -> None:
        for name in ("target", "drafter"):  # a dead target makes the drafter's state moot
            handle = self.workers[name]
            if handle.state != UP:
                continue
            if not handle.alive():
                await self.fault(name, f"exited with code {handle.process.exitcode}")
            elif (why := self.heartbeats.hung(name)) is not None:
                await self.fault(name, why)

    async def fault(self, worker: str, reason: str, pid: int | None = None) -> None:
        """Act on a worker fault (process end, silence, or its own WorkerDead message)."""
        async with self._fault_lock:
            handle = self.workers.get(worker)
            if self._stopping or handle is None or handle.state != UP or (pid is not None and pid != handle.pid):
                return  # handled already, or news of an incarnation that is gone
            log.error("the %s worker (pid %s) %s", worker, handle.pid, reason)
            handle.last_fault = f"{reason} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
            if worker == "target":
                await self._target_fault(reason)
            else:
                await self._drafter_fault(reason)

    async def _drafter_fault(self, reason: str) -> None:
        self._set_state("drafter", DOWN)
        # Killed before the target hears of it, so that nothing the target frees (CUDA slots) is read late.
        await self._kill(self.workers["drafter"])
        await self._tell_drafter_status(False, reason)
        self._drafter_restart = asyncio.create_task(self._restart_drafter(), name="foresight-drafter-restart")

    async def _restart_drafter(self) -> None:
        if await self._restart("drafter", self._start_drafter_alone):
            await self._tell_drafter_status(True, "")

    async def _target_fault(self, reason: str) -> None:
        self._set_state("target", DOWN)
        if self._drafter_restart is not None:
            self._drafter_restart.cancel()
            await asyncio.gather(self._drafter_restart, return_exceptions=True)
        if self.hooks.target_lost is not None:
            await self.hooks.target_lost(f"the target worker {reason}")
        for name in ("target", "drafter"):
            self._set_state(name, DOWN)
            await self._kill(self.workers[name])
        await self._restart("target", self._start_pair)

    async def _restart(self, worker: str, start: Callable[[], Awaitable[None]]) -> bool:
        """Start again until it works or the budget is spent (then: fatal)."""
        handle = self.workers[worker]
        while not self._stopping:
            if not self.budgets[worker].spend():
                self._give_up(worker)
                return False
            handle.restarts += 1
            try:
                await start()
            except Exception as exc:  # WorkerStartError, or anything else: the next try starts clean
                log.error("restarting the %s worker failed: %s", worker, exc)
                for name in WORKERS if worker == "target" else (worker,):
                    await self._kill(self.workers[name])
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            log.info("the %s worker is back (pid %s)", worker, handle.pid)
            if self.hooks.restarted is not None:
                self.hooks.restarted(worker)
            return True
        return False

    def _give_up(self, worker: str) -> None:
        reason = (f"the {worker} worker failed more than {self.max_restarts} times within "
                  f"{self.restart_window_s:g} s")
        log.critical("%s: giving up", reason)
        self._set_state(worker, FAILED)
        if self.hooks.fatal is not None:
            self.hooks.fatal(reason)

    async def _tell_drafter_status(self, up: bool, reason: str) -> None:
        if self.hooks.drafter_status is not None:
            await self.hooks.drafter_status(up, reason)

    # ------------------------------------------------------------------ stopping

    async def _kill(self, handle: WorkerHandle) -> None:
        """SIGKILL (a hung worker would not act on SIGTERM) and reap; then free what it left in /dev/shm."""
        await _end_process(handle.process, graceful=False)
        self._forget(handle)

    async def stop(self) -> None:
        """Stop both workers for good: SIGTERM (they leave through their normal exit path), SIGKILL after
        STOP_GRACE_S."""
        self._stopping = True
        for task in (self._monitor, self._drafter_restart):
            if task is not None:
                task.cancel()
        for name in ("target", "drafter"):
            handle = self.workers[name]
            await _end_process(handle.process, graceful=True)
            self._forget(handle)
            self._set_state(name, DOWN)

    def _forget(self, handle: WorkerHandle) -> None:
        if handle.process is not None and handle.process.pid is not None:
            sweep_shm(handle.process.pid)
        handle.process = None
        handle.ready = None
        self.heartbeats.forget(handle.name)


async def _end_process(proc: mp.process.BaseProcess | None, graceful: bool) -> None:
    if proc is None or proc.pid is None:
        return
    if graceful and proc.is_alive():
        proc.terminate()
        if await _exited(proc, STOP_GRACE_S):
            return
        log.warning("the %s process did not stop within %.0f s of SIGTERM: killing it", proc.name, STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()
    await _exited(proc, STOP_GRACE_S)


async def _exited(proc: mp.process.BaseProcess, timeout_s: float) -> bool:
    """Wait (without blocking the event loop) for the process to end and be reaped."""
    deadline = time.monotonic() + timeout_s
    while proc.exitcode is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _pairing(drafter: WorkerReady) -> tuple[HiddenLayout, list, list]:
    """What the target is started with from the drafter's ready message: the target states it reads, the
    strategies it offers and those mode auto picks from (a drafter restarted beside it must want the same)."""
    info = drafter.info
    return drafter.layout or HiddenLayout(), info.get("strategies", []), info.get("auto_strategies", [])


def _run_worker(module: str, args: tuple) -> None:
    import importlib

    importlib.import_module(module).main(*args)
