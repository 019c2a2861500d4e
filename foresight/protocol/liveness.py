"""Telling the api that a worker is about to die, so it need not wait for the process sentinel."""
from __future__ import annotations

import time

import zmq

from .addresses import WorkerAddresses
from .messages import WorkerDead
from .sockets import MessageSocket


def report_death(ctx: zmq.Context, addrs: WorkerAddresses, worker: str, exc: BaseException) -> None:
    if isinstance(exc, KeyboardInterrupt):
        return
    try:
        sock = MessageSocket(ctx, zmq.PUSH, addrs.workers_to_api, bind=False)
        sock.send(WorkerDead(worker=worker, error=f"{type(exc).__name__}: {exc}"))
        time.sleep(0.2)  # let the message leave before the context is destroyed
        sock.close()
    except Exception:
        pass


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Make this worker exit when the process that spawned it dies (no orphaned workers)."""
    import os
    import signal
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
