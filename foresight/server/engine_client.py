"""The api process's side of the engine: sends requests to the target worker, routes its outputs.

Used by the HTTP app and by the benchmark alike. One asyncio task reads everything the workers
send (`recv_from_workers`) and dispatches by message type; each request reads its own queue.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.messages import (
    AbortRequest,
    GenerateRequest,
    RequestFailed,
    Shutdown,
    TokenOutput,
    WorkerDead,
    WorkerReady,
)
from ..protocol.sockets import AsyncMessageSocket
from .supervisor import Supervisor


class EngineUnavailable(RuntimeError):
    """No healthy workers (starting, restarting, or given up): the api answers 503."""


class QueueFull(RuntimeError):
    """Too many requests waiting: the api answers 429."""


class RequestError(RuntimeError):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class _Failure:
    error: str
    status: int


class EngineClient:
    def __init__(self, cfg: EngineConfig, max_running: int = 16, max_waiting: int = 64,
                 startup_timeout_s: float = 600.0, max_restarts: int = 5, metrics=None):
        self.cfg = cfg
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.addrs = WorkerAddresses.fresh()
        self.ctx = zmq.asyncio.Context()
        self.send_to_target = AsyncMessageSocket(self.ctx, zmq.PUSH, self.addrs.api_to_target, bind=True)
        self.recv_from_workers = AsyncMessageSocket(self.ctx, zmq.PULL, self.addrs.workers_to_api, bind=True)
        self.queues: dict[str, asyncio.Queue] = {}
        self.slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self._ids = itertools.count()
        self.supervisor = Supervisor(cfg, self.addrs, startup_timeout_s, max_restarts,
                                     on_state_change=self._worker_state, on_restart=self._worker_restart,
                                     on_death=self._fail_all)
        self._reader: asyncio.Task | None = None
        self.handlers = {
            TokenOutput: self._on_tokens,
            RequestFailed: self._on_failed,
            WorkerReady: self.supervisor.on_ready,
            WorkerDead: self._on_dead,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop())
        await self.supervisor.start()

    async def stop(self) -> None:
        try:
            await self.send_to_target.send(Shutdown(reason="api stopping"))
        except Exception:
            pass
        await self.supervisor.stop()
        if self._reader is not None:
            self._reader.cancel()
        self.ctx.destroy(linger=0)

    @property
    def healthy(self) -> bool:
        return self.supervisor.healthy

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
                    raise RequestError(item.error, item.status)
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

    # ------------------------------------------------------------------ worker messages

    async def _read_loop(self) -> None:
        while True:
            msg = await self.recv_from_workers.recv()
            handler = self.handlers.get(type(msg))
            if handler is None:
                continue
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
        asyncio.create_task(self.supervisor.handle_death(msg.worker, msg.error))

    async def _fail_all(self, worker: str, reason: str) -> None:
        for queue in list(self.queues.values()):
            queue.put_nowait(_Failure(f"the {worker} worker died ({reason}); it is being restarted", 503))
        self.send_to_target.reset()  # drop requests queued for the dead worker

    def _worker_state(self, worker: str, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.set_worker_up(worker, up)

    def _worker_restart(self, worker: str) -> None:
        if self.metrics is not None:
            self.metrics.record_worker_restart(worker)

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, self.waiting)
