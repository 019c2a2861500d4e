"""Graceful shutdown: on SIGTERM (or SIGINT) stop admitting, let in-flight requests finish within the
drain timeout, abort what is left with a clear error, then let uvicorn stop and the workers go.

uvicorn's own handling would close the listening socket at once (new clients refused, not answered
503, and health checks unanswered while requests drain) and re-raise the signal at the end (exit status
143 for a clean stop); `DrainingServer` replaces it with the drain.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import uvicorn

log = logging.getLogger("foresight.server")

POLL_S = 0.1
ABORT_GRACE_S = 5.0  # after the abort, how long aborted requests get to send their error
DRAIN_ABORTED = "the server is shutting down and stopped this request after its drain timeout ({timeout:g} s)"


class Drain:
    """Started once (by a signal, or by the engine giving up); `on_done` is called when it is over."""

    def __init__(self, engine, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        self.draining = False
        self.exit_code = 0
        self.on_done: Callable[[], None] | None = None
        self.task: asyncio.Task | None = None

    def begin(self, exit_code: int = 0, why: str = "a stop signal") -> None:
        """Stop admitting and start draining (in the running loop). A non-zero code sticks."""
        self.exit_code = self.exit_code or exit_code
        if self.draining:
            return
        self.draining = True
        self.engine.close_admission()
        log.info("draining on %s: no new requests; %d in flight get up to %g s to finish",
                 why, self.engine.in_flight, self.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._run(), name="foresight-drain")

    async def _run(self) -> None:
        if not await self._idle_within(self.timeout_s):
            left = self.engine.in_flight
            log.warning("drain timeout (%g s): aborting %d requests still in flight", self.timeout_s, left)
            await self.engine.abort_all(DRAIN_ABORTED.format(timeout=self.timeout_s))
            await self._idle_within(ABORT_GRACE_S)
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
    """uvicorn, with stop signals routed to a `Drain`; a second SIGINT still forces the exit."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.on_done = self._exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain.draining and sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
            return
        if self._loop is None:
            self.should_exit = True
            return
        # A signal handler must not touch the loop's state directly; this is the thread-safe door.
        self._loop.call_soon_threadsafe(self.drain.begin, 0, signal.Signals(sig).name)

    def _exit(self) -> None:
        self.should_exit = True
