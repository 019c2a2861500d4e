"""The api process's side of the engine: sends requests to the target worker, routes its outputs.

Used by the HTTP app and by the benchmark alike. One asyncio task reads everything the workers
send (`recv_from_workers`) and dispatches by message type; each request reads its own queue. That
reader is supervised: a message that cannot be handled is logged and dropped, and a reader that dies
anyway is logged, counted as unhealthy, and started again (never a silent stall of every request).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.errors import ProtocolError
from ..protocol.leftovers import sweep_stale
from ..protocol.messages import (
    AbortRequest,
    DrafterStatus,
    GenerateRequest,
    Heartbeat,
    RequestFailed,
    Shutdown,
    TokenOutput,
    WorkerDead,
    WorkerReady,
)
from ..protocol.sockets import AsyncMessageSocket
from .supervisor import Hooks, Supervisor

log = logging.getLogger("foresight.engine")

CONTROL_SEND_TIMEOUT_S = 5.0  # a control message the target cannot take within this is dropped (it is dead)
READER_RETRY_S = 0.5
READER_MAX_CRASHES = 5  # in a row, without a message handled in between: then the api gives up


class EngineUnavailable(RuntimeError):
    """No healthy workers (starting, restarting, or given up): the api answers 503."""


class QueueFull(RuntimeError):
    """Too many requests waiting: the api answers 429."""


class RequestError(RuntimeError):
    """A request failed after admission. `public`: the message is ours and may go to the client as is
    (otherwise it may quote an exception and the client gets a generic one)."""

    def __init__(self, message: str, status: int = 500, public: bool = False):
        super().__init__(message)
        self.status = status
        self.public = public


@dataclass
class _Failure:
    error: str
    status: int
    public: bool = False


class EngineClient:
    def __init__(self, cfg: EngineConfig, max_running: int = 16, max_waiting: int = 64,
                 startup_timeout_s: float = 600.0, max_restarts: int = 5, metrics=None, *,
                 restart_window_s: float = 600.0, heartbeat_timeout_s: float = 5.0, stall_timeout_s: float = 300.0):
        self.cfg = cfg
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.admitting = True
        self._abort_reason: str | None = None  # set by abort_all: requests still queued fail too
        self.on_fatal: Callable[[str], None] | None = None  # the api exits (non-zero) when this is called
        self.reader_crashes = 0
        self.addrs = WorkerAddresses.fresh()
        self.ctx = zmq.asyncio.Context()
        self.send_to_target = AsyncMessageSocket(self.ctx, zmq.PUSH, self.addrs.api_to_target, bind=True)
        self.recv_from_workers = AsyncMessageSocket(self.ctx, zmq.PULL, self.addrs.workers_to_api, bind=True)
        self.queues: dict[str, asyncio.Queue] = {}
        self.slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self._ids = itertools.count()
        hooks = Hooks(state_changed=self._worker_state, restarted=self._worker_restart,
                      target_lost=self._fail_all, drafter_status=self._drafter_status, fatal=self._fatal)
        self.supervisor = Supervisor(cfg, self.addrs, startup_timeout_s, max_restarts, restart_window_s,
                                     heartbeat_timeout_s, stall_timeout_s, hooks)
        self._reader: asyncio.Task | None = None
        self.handlers = {
            TokenOutput: self._on_tokens,
            RequestFailed: self._on_failed,
            WorkerReady: self.supervisor.on_ready,
            Heartbeat: self.supervisor.on_heartbeat,
            WorkerDead: self._on_dead,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        swept = sweep_stale()
        if swept.folders or swept.segments:
            log.info("removed what dead instances left behind: %d socket folders, %d shared-memory segments",
                     swept.folders, swept.segments)
        self._start_reader()
        await self.supervisor.start()

    async def stop(self) -> None:
        """Stop the workers and leave nothing behind: sockets, their folder, shared memory."""
        self.admitting = False
        await self._send_control(Shutdown(reason="api stopping"))
        await self.supervisor.stop()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.ctx.destroy(linger=0)
        self.addrs.remove()

    @property
    def healthy(self) -> bool:
        """The target serves and its outputs are being read."""
        return self.supervisor.healthy and self.reading

    @property
    def reading(self) -> bool:
        return self._reader is not None and not self._reader.done()

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    def close_admission(self) -> None:
        """From now on generate() refuses new requests (503); admitted ones go on."""
        self.admitting = False

    def health(self) -> dict:
        """What /health says: status ok | degraded (serving without the drafter) | unavailable | draining."""
        if not self.admitting:
            status = "draining"
        elif not self.healthy:
            status = "unavailable"
        else:
            status = "degraded" if self.supervisor.degraded else "ok"
        return {"status": status, "workers": self.worker_pids(), "worker_state": self.supervisor.report(),
                "restarts": self.supervisor.restarts, "in_flight": self.in_flight,
                "reader": "running" if self.reading else "stopped"}

    def target_info(self) -> dict:
        return self.supervisor.worker_info("target")

    def worker_pids(self) -> dict[str, int | None]:
        return {name: (h.ready.pid if h.ready else None) for name, h in self.supervisor.workers.items()}

    def drafter_info(self) -> dict:
        return self.supervisor.worker_info("drafter")

    # ------------------------------------------------------------------ requests

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def can_admit(self) -> bool:
        return not (self.waiting >= self.max_waiting and self.slots.locked())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Yield the request's outputs until it finishes; abort it if the caller goes away."""
        if not self.admitting:
            raise EngineUnavailable("the server is shutting down and admits no new requests")
        if not self.healthy:
            raise EngineUnavailable("the engine is not ready (starting, or a worker died)")
        if not self.can_admit():
            raise QueueFull(f"too many requests waiting ({self.waiting})")
        self.waiting += 1
        self._publish_queue()
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        if self._abort_reason is not None:
            self.slots.release()
            self._publish_queue()
            raise RequestError(self._abort_reason, 503, public=True)
        self.running += 1
        self._publish_queue()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.req_id] = queue
        finished = released = False
        try:
            await self.send_to_target.send(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, _Failure):
                    finished = True
                    raise RequestError(item.error, item.status, item.public)
                finished = item.finished
                if finished:
                    # The worker is done: free the slot now, not when a slow client has read the rest.
                    released = True
                    self._release(request.req_id)
                yield item
        finally:
            if not released:
                self._release(request.req_id)
            if not finished:
                await self.abort(request.req_id)

    def _release(self, req_id: str) -> None:
        self.queues.pop(req_id, None)
        self.running -= 1
        self.slots.release()
        self._publish_queue()

    async def abort(self, req_id: str) -> None:
        try:
            await self.send_to_target.send(AbortRequest(req_id=req_id))
        except Exception:
            pass

    async def abort_all(self, reason: str) -> None:
        """Fail every admitted request with 503 and `reason` (shown to clients) and stop it in the target;
        requests still queued for a slot fail as they get one."""
        self._abort_reason = reason
        for req_id, queue in list(self.queues.items()):
            queue.put_nowait(_Failure(reason, 503, public=True))
            await self.abort(req_id)

    # ------------------------------------------------------------------ worker messages

    def _start_reader(self) -> None:
        self._reader = asyncio.create_task(self._read_loop(), name="foresight-reader")
        self._reader.add_done_callback(self._reader_ended)

    def _reader_ended(self, task: asyncio.Task) -> None:
        """The reader never returns: if it ended, it crashed. Restart it, or give up after repeated crashes."""
        if task.cancelled():
            return  # stop()
        self.reader_crashes += 1
        log.critical("the api's reader of worker messages died (%d in a row); /health fails until it runs",
                     self.reader_crashes, exc_info=task.exception())
        if self.reader_crashes >= READER_MAX_CRASHES:
            self._fatal(f"the reader of worker messages died {self.reader_crashes} times in a row")
            return
        asyncio.get_running_loop().call_later(READER_RETRY_S, self._start_reader)

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = await self.recv_from_workers.recv()
            except ProtocolError:
                log.exception("a malformed message from a worker; dropped")
                continue
            try:
                await self._dispatch(msg)
            except Exception:  # one bad message must not stop every request's outputs
                log.exception("a %s message from a worker could not be handled; dropped", type(msg).__name__)
            self.reader_crashes = 0

    async def _dispatch(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            return
        result = handler(msg)
        if asyncio.iscoroutine(result):
            await result

    def _on_tokens(self, msg: TokenOutput) -> None:
        queue = self.queues.get(msg.req_id)
        if queue is not None:
            queue.put_nowait(msg)

    def _on_failed(self, msg: RequestFailed) -> None:
        queue = self.queues.get(msg.req_id)
        if queue is not None:
            queue.put_nowait(_Failure(msg.error, msg.status))

    async def _on_dead(self, msg: WorkerDead) -> None:
        # A task of its own: handling a fault restarts workers, and this reader must go on meanwhile.
        asyncio.create_task(self.supervisor.fault(msg.worker, f"died ({msg.error})", pid=msg.pid or None))

    async def _fail_all(self, reason: str) -> None:
        for queue in list(self.queues.values()):
            queue.put_nowait(_Failure(f"{reason}; it is being restarted", 503))
        self.send_to_target.reset()  # drop requests queued for the dead worker

    async def _drafter_status(self, up: bool, reason: str) -> None:
        await self._send_control(DrafterStatus(up=up, reason=reason))

    async def _send_control(self, msg) -> None:
        """A message to the target that must not hold up the caller if the target cannot take it."""
        try:
            await asyncio.wait_for(self.send_to_target.send(msg), CONTROL_SEND_TIMEOUT_S)
        except Exception:
            log.warning("the target could not take %s; dropped", type(msg).__name__)

    def _fatal(self, reason: str) -> None:
        log.critical("the engine cannot go on: %s", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _worker_state(self, worker: str, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_worker_up(worker, up)

    def _worker_restart(self, worker: str) -> None:
        if self.metrics is not None:
            self.metrics.record_worker_restart(worker)

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, self.waiting)
