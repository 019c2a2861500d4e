"""A worker process's side of its supervision: heartbeats, signals, logging, and a clean end.

The api's supervisor decides every restart; a worker only says that it lives (`Heartbeat`), that it
dies (`WorkerDead`), and leaves nothing behind when it stops.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from .addresses import WorkerAddresses
from .messages import Heartbeat, WorkerDead
from .sockets import MessageSocket
from .transport import default_transport

# How often a worker's loop reports. The supervisor's --heartbeat-timeout must be several of these.
HEARTBEAT_INTERVAL_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"


class Heartbeats:
    """A thread that sends a `Heartbeat` every `interval_s`, with how long ago the worker's loop last
    turned (`turn()`, called once per turn of the loop).

    Two faults, two signs: a stopped (SIGSTOP), frozen or dead process sends nothing at all, which the
    supervisor notices within seconds; a loop stuck in one step (a deadlock, a kernel that never ends)
    still beats but reports a growing stall, judged against a much longer limit, since one legitimate
    step (a long prompt's prefill on a CPU) can take a minute. Beating from a thread is what keeps the
    first from being confused with the second. The thread has its own socket (zmq sockets are not
    thread-safe) and never blocks on the api."""

    def __init__(self, ctx: zmq.Context, address: str, worker: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 clock=time.monotonic):
        self.ctx, self.address, self.worker, self.interval_s, self.clock = ctx, address, worker, interval_s, clock
        self.pid = os.getpid()
        self.turned_at = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker}-heartbeat", daemon=True)

    def turn(self) -> None:
        self.turned_at = self.clock()

    def beat(self) -> Heartbeat:
        return Heartbeat(worker=self.worker, pid=self.pid, stalled_s=max(0.0, self.clock() - self.turned_at))

    def __enter__(self) -> "Heartbeats":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = MessageSocket(self.ctx, zmq.PUSH, self.address, bind=False)
        try:
            while not self._stop.wait(self.interval_s):
                sock.send(self.beat(), block=False)
        except zmq.ZMQError:
            pass  # the context is being destroyed: the worker is ending
        finally:
            sock.close()


def prepare_worker_process() -> None:
    """Logging, signals and locks of a freshly spawned worker, before anything heavy is imported."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # Ctrl+C reaches the whole process group; the api alone decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    _thread_lock_for_progress_bars()
    exit_with_parent()


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM ends the worker through its normal exit path (finally blocks, multiprocessing's
    finalizers), so its CUDA rings and semaphores are released; a second SIGTERM is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def _thread_lock_for_progress_bars() -> None:
    """tqdm (model loading bars) guards its output with a multiprocessing lock, which in a spawned
    process is a named POSIX semaphore that a killed process leaves in /dev/shm. A worker has no child
    processes sharing its terminal, so a thread lock does the same job and cannot leak."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


@contextmanager
def worker_lifetime(ctx: zmq.Context, addrs: WorkerAddresses, worker: str) -> Iterator[None]:
    """Around a worker's whole life: report an unexpected end to the api, and always free the CUDA IPC
    rings (and their flag segments) and the sockets."""
    try:
        yield
    except BaseException as exc:
        report_death(ctx, addrs, worker, exc)
        raise
    finally:
        default_transport().close()
        ctx.destroy(linger=0)


def report_death(ctx: zmq.Context, addrs: WorkerAddresses, worker: str, exc: BaseException) -> None:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return  # a requested stop, not a death
    logging.getLogger(f"foresight.{worker}").critical("the %s worker loop died", worker, exc_info=exc)
    try:
        sock = MessageSocket(ctx, zmq.PUSH, addrs.workers_to_api, bind=False)
        # The type only: exception text stays in this process's log (it may quote request data).
        sock.send(WorkerDead(worker=worker, error=type(exc).__name__, pid=os.getpid()), block=False)
        time.sleep(0.2)  # let the message leave before the context is destroyed
        sock.close()
    except Exception:
        pass


def exit_with_parent(poll_s: float = 1.0, grace_s: float = 5.0) -> None:
    """Make this worker exit when the process that spawned it dies (no orphaned workers): SIGTERM for a
    clean end, SIGKILL if the loop does not get there."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
