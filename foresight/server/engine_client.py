"""The api process's side of the engine: sends requests to the target worker, routes its outputs.

Used by the HTTP app and by the benchmark alike. One asyncio task reads everything the workers
send (`recv_from_workers`) and dispatches by message type; each request reads its own queue. That
reader is supervised: a message that cannot be handled is logged and dropped, and a reader that dies
anyway is logged, counted as unhealthy, and started again (never a silent stall of every request).

Admission (as vLLM's scheduler, first come first served): a request runs once a sequence slot
(`max_num_seqs`) is free and its KV reservation fits the token budget (`max_kv_tokens`, None = none).
The reservation is the request's worst-case footprint, len(prompt_ids) + max_tokens (at most the target's
max_model_len), held until the request finishes, fails or is aborted. Verify blocks fit in it: the target
never drafts past max_tokens (`TargetWorker.max_drafts`), so a block's drafts occupy positions the
request's own later tokens would. Requests wait in one FIFO: a
later, smaller request never overtakes the head of the queue (no starvation of long requests). One
larger than the whole budget is refused at once (`KVBudgetExceeded`, 400); beyond `max_waiting` waiting
requests a new one is refused (`QueueFull`, 429). `admit()` decides that synchronously, so the HTTP
app answers 400/429 before any stream starts; `generate()` then waits for the request's turn.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.errors import ProtocolError
from ..protocol.leftovers import sweep_stale
from ..protocol.messages import (
    AbortRequest,
    ControllerStats,
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


class KVBudgetExceeded(RequestError):
    """The request's KV reservation alone exceeds the whole --max-kv-tokens budget: it could never run.
    The api answers 400 naming `max_tokens`."""

    param = "max_tokens"

    def __init__(self, message: str):
        super().__init__(message, 400, public=True)


@dataclass
class _Failure:
    error: str
    status: int
    public: bool = False


WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass(eq=False)
class _Ticket:
    """One request's admission: waiting in the FIFO, running (holding a slot and `tokens`), or done."""

    req_id: str
    tokens: int  # its KV reservation
    turn: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    state: str = WAITING


class EngineClient:
    def __init__(self, cfg: EngineConfig, max_num_seqs: int = 16, max_waiting: int = 64,
                 startup_timeout_s: float = 900.0, max_restarts: int = 5, metrics=None, *,
                 restart_window_s: float = 600.0, heartbeat_timeout_s: float = 5.0, stall_timeout_s: float = 300.0,
                 max_kv_tokens: int | None = None):
        self.cfg = cfg
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.max_kv_tokens = max_kv_tokens  # None: no token budget
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
        self.running = 0  # requests holding a sequence slot
        self.kv_reserved = 0  # KV tokens the running requests reserve
        self._waitlist: deque[_Ticket] = deque()  # FIFO of requests waiting for admission
        self._tickets: dict[str, _Ticket] = {}  # admitted by admit(), not yet claimed by generate()
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
            ControllerStats: self._on_controllers,
        }
        self._publish_queue()  # the budget, from the first scrape

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        swept = sweep_stale()
        if swept.folders or swept.segments:
            log.info("removed what dead instances left behind: %d socket folders, %d shared-memory segments",
                     swept.folders, swept.segments)
        self._start_reader()
        await self.supervisor.start()
        max_len = self._max_model_len()
        if self.max_kv_tokens is not None and max_len and self.max_kv_tokens < max_len:
            log.warning("--max-kv-tokens %d is below the context length (%d): a request that asks for more "
                        "(a request without max_tokens asks for the whole context) is refused with 400",
                        self.max_kv_tokens, max_len)

    async def stop(self) -> None:
        """Stop the workers and leave nothing behind: sockets, their folder, shared memory."""
        self.admitting = False
        if self.supervisor.target_started:  # a target still loading has no socket to hear it (SIGTERM does)
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
    def waiting(self) -> int:
        return len(self._waitlist)

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
                "running": self.running, "waiting": self.waiting, "max_num_seqs": self.max_num_seqs,
                "max_waiting": self.max_waiting,
                "kv_tokens": {"reserved": self.kv_reserved, "budget": self.max_kv_tokens},
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
        """Whether a new request could still queue (a cheap check before tokenizing; admit() decides)."""
        return self.waiting < self.max_waiting or (not self._waitlist and self.running < self.max_num_seqs)

    def _max_model_len(self) -> int | None:
        return self.target_info().get("max_model_len") or self.cfg.max_model_len

    def reservation(self, request: GenerateRequest) -> int:
        """KV tokens `request` may fill at most: its prompt plus max_tokens, at most the context length."""
        tokens = len(request.prompt_ids) + request.max_tokens
        max_len = self._max_model_len()
        return min(tokens, max_len) if max_len else tokens

    def admit(self, request: GenerateRequest) -> None:
        """Queue `request` for admission now, without waiting: it runs at once if nobody waits and a slot
        and its KV reservation fit, else it joins the FIFO. Raises EngineUnavailable (503),
        KVBudgetExceeded (400) or QueueFull (429). `generate(request)` then waits for its turn; a request
        admitted here whose generate() never starts must be given back with `discard(req_id)`."""
        self._tickets[request.req_id] = self._admit(request)

    def discard(self, req_id: str) -> None:
        """Give back the admission of a request that generate() never took over (no-op otherwise)."""
        ticket = self._tickets.pop(req_id, None)
        if ticket is not None:
            self._finish(ticket)

    def _admit(self, request: GenerateRequest) -> _Ticket:
        if not self.admitting:
            raise EngineUnavailable("the server is shutting down and admits no new requests")
        if not self.healthy:
            raise EngineUnavailable("the engine is not ready (starting, or a worker died)")
        tokens = self.reservation(request)
        if self.max_kv_tokens is not None and tokens > self.max_kv_tokens:
            n_prompt = len(request.prompt_ids)
            raise KVBudgetExceeded(
                f"this request may need {tokens} KV-cache tokens ({n_prompt} in the prompt + max_tokens "
                f"{request.max_tokens}), more than the server's whole KV budget of {self.max_kv_tokens} tokens "
                f"(--max-kv-tokens); set max_tokens to at most {max(self.max_kv_tokens - n_prompt, 0)}")
        ticket = _Ticket(request.req_id, tokens)
        if not self._waitlist and self._fits(tokens):
            self._run(ticket)
        elif self.waiting >= self.max_waiting:
            raise QueueFull(f"too many requests waiting ({self.waiting})")
        else:
            self._waitlist.append(ticket)
        self._publish_queue()
        return ticket

    def _fits(self, tokens: int) -> bool:
        return self.running < self.max_num_seqs and (
            self.max_kv_tokens is None or self.kv_reserved + tokens <= self.max_kv_tokens)

    def _run(self, ticket: _Ticket) -> None:
        ticket.state = RUNNING
        self.running += 1
        self.kv_reserved += ticket.tokens
        if not ticket.turn.done():
            ticket.turn.set_result(None)

    def _finish(self, ticket: _Ticket) -> None:
        """The request leaves (finished, failed, aborted, gone while waiting): free what it holds and let
        the head of the queue in while it fits. Idempotent."""
        if ticket.state == WAITING:
            self._waitlist.remove(ticket)
        elif ticket.state == RUNNING:
            self.running -= 1
            self.kv_reserved -= ticket.tokens
        else:
            return
        ticket.state = DONE
        while self._waitlist and self._fits(self._waitlist[0].tokens):
            self._run(self._waitlist.popleft())
        self._publish_queue()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Wait for the request's turn (admitting it first unless admit() did), then yield its outputs until
        it finishes; abort it if the caller goes away. Its slot and KV reservation are freed on every exit."""
        ticket = self._tickets.pop(request.req_id, None) or self._admit(request)
        finished = admitted = False
        try:
            if ticket.state == WAITING:
                await ticket.turn
            if ticket.state != RUNNING or self._abort_reason is not None:  # abort_all while it waited
                raise RequestError(self._abort_reason or "the request was stopped before it ran", 503, public=True)
            admitted = True
            queue: asyncio.Queue = asyncio.Queue()
            self.queues[request.req_id] = queue
            await self.send_to_target.send(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, _Failure):
                    finished = True
                    raise RequestError(item.error, item.status, item.public)
                finished = item.finished
                if finished:
                    # The worker is done: free the slot now, not when a slow client has read the rest.
                    self.queues.pop(request.req_id, None)
                    self._finish(ticket)
                yield item
        finally:
            if admitted:
                self.queues.pop(request.req_id, None)
            self._finish(ticket)
            if admitted and not finished:
                await self.abort(request.req_id)

    async def abort(self, req_id: str) -> None:
        try:
            await self.send_to_target.send(AbortRequest(req_id=req_id))
        except Exception:
            pass

    async def abort_all(self, reason: str) -> None:
        """Fail every request with 503 and `reason` (shown to clients): admitted ones are stopped in the
        target, waiting ones leave the queue at once."""
        self._abort_reason = reason
        while self._waitlist:
            ticket = self._waitlist.popleft()
            ticket.state = DONE
            if not ticket.turn.done():
                ticket.turn.set_result(None)
        self._publish_queue()
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

    def _on_controllers(self, msg: ControllerStats) -> None:
        if self.metrics is not None:
            self.metrics.record_controllers(msg)

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
            self.metrics.set_kv_tokens(self.kv_reserved, self.max_kv_tokens)
