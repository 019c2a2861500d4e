"""Graceful shutdown: on SIGTERM (or SIGINT) stop admitting, let in-flight requests finish within the
drain timeout, abort what is left with a clear error, then let uvicorn stop and the workers go.

uvicorn's own handling would close the listening socket at once (new clients refused, not answered
503, and health checks unanswered while requests drain) and re-raise the signal at the end (exit status
143 for a clean stop); `DrainingServer` replaces it with the drain. The edges:
- a stop signal during start-up (the workers loading) cancels the start: the workers are stopped and the
  server exits 0 without serving; one before the engine exists exits 0 at once (`EarlyStop`);
- a second SIGINT (an impatient Ctrl-C) ends the drain now: what is in flight is aborted with an error
  event and `[DONE]`, then the server stops as after any drain (workers and socket folder gone);
- a third SIGINT forces the exit; the socket folder is still removed (`protocol/leftovers.remove_own_folders`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger("foresight.server")

POLL_S = 0.1
ABORT_GRACE_S = 5.0  # after the abort, how long aborted requests get to send their error
DRAIN_ABORTED = "the server is shutting down and stopped this request after its drain timeout ({timeout:g} s)"
STOPPED_NOW = "the server was stopped at once (a second interrupt) and stopped this request"


class EarlyStop:
    """Stop signals before uvicorn takes them over (SIGTERM would otherwise kill the process: status 143).

    Until `defer()` nothing exists that needs cleaning up (no workers, no socket folder), so a signal exits
    0 at once; python cannot unwind safely from the middle of an import (`import torch` half done breaks
    every later import of it). After `defer()` (the engine about to be made) a signal is only remembered,
    and `DrainingServer` begins the drain with it as soon as it runs: the start-up is then cancelled.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None

    def install(self) -> "EarlyStop":
        for sig in self.SIGNALS:
            signal.signal(sig, self._exit)
        return self

    def defer(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._remember)

    @staticmethod
    def _exit(sig: int, frame) -> None:
        os.write(2, f"foresight: stopped by {signal.Signals(sig).name} before serving\n".encode())
        os._exit(0)

    def _remember(self, sig: int, frame) -> None:
        self.received = self.received or sig


class Drain:
    """Started once (by a signal, or by the engine giving up); `on_done` is called when it is over."""

    def __init__(self, engine, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        self.draining = False
        self.exit_code = 0
        self.on_done: Callable[[], None] | None = None
        self.task: asyncio.Task | None = None
        self.aborting = False
        self._startup: asyncio.Future | None = None

    async def starting(self, start: Awaitable) -> bool:
        """Run the engine's start-up; False when a stop signal cancelled it (`begin` during start-up)."""
        self._startup = asyncio.ensure_future(start)
        if self.draining:
            self._startup.cancel()
        try:
            await self._startup
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or not self.draining:
                raise  # cancelled from outside, not by a stop signal
            return False
        return True

    def begin(self, exit_code: int = 0, why: str = "a stop signal") -> None:
        """Stop admitting and start draining (in the running loop). A non-zero code sticks."""
        self.exit_code = self.exit_code or exit_code
        if self.draining:
            return
        self.draining = True
        self.engine.close_admission()
        if self._startup is not None and not self._startup.done():
            log.info("stopping on %s during start-up: the workers are stopped, nothing is served", why)
            self._startup.cancel()
        else:
            log.info("draining on %s: no new requests; %d in flight get up to %g s to finish",
                     why, self.engine.in_flight, self.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._run(), name="foresight-drain")

    def abort_now(self, why: str = "a second interrupt") -> None:
        """End a drain at once: abort what is in flight (each client gets an error), then stop as usual."""
        if not self.draining or self.aborting:
            return
        self.aborting = True
        log.warning("%s: aborting the %d requests in flight now", why, self.engine.in_flight)
        if self.task is not None:
            self.task.cancel()
        self.task = asyncio.get_running_loop().create_task(self._abort(STOPPED_NOW), name="foresight-abort")

    async def _run(self) -> None:
        if not await self._idle_within(self.timeout_s):
            left = self.engine.in_flight
            log.warning("drain timeout (%g s): aborting %d requests still in flight", self.timeout_s, left)
            await self._abort(DRAIN_ABORTED.format(timeout=self.timeout_s))
            return
        self._done()

    async def _abort(self, message: str) -> None:
        await self.engine.abort_all(message)
        await self._idle_within(ABORT_GRACE_S)
        self._done()

    def _done(self) -> None:
        log.info("drained; stopping")
        if self.on_done is not None:
            self.on_done()

    async def _idle_within(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.engine.in_flight > 0:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn, with stop signals routed to a `Drain`; a second SIGINT aborts the drain, a third forces
    the exit."""

    def __init__(self, config: uvicorn.Config, drain: Drain, early: EarlyStop | None = None):
        super().__init__(config)
        self.drain = drain
        self.early = early
        drain.on_done = self._exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.early is not None and self.early.received:  # a signal came while the app was being made
            self.drain.begin(0, signal.Signals(self.early.received).name)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or (self.drain.aborting and sig == signal.SIGINT):
            self.force_exit = self.should_exit = True
            return
        # A signal handler must not touch the loop's state directly; this is the thread-safe door.
        if self.drain.draining and sig == signal.SIGINT:
            self._loop.call_soon_threadsafe(self.drain.abort_now)
            return
        self._loop.call_soon_threadsafe(self.drain.begin, 0, signal.Signals(sig).name)

    def _exit(self) -> None:
        self.should_exit = True
