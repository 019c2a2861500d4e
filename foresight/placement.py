"""Which CPU cores each process runs on (`--target-cores`, `--drafter-cores`).

On a machine with many cores, two workers left to the scheduler (and their OpenMP thread pools) can land on the same
cores, where busy-waiting thread pools slow each other far more than their share. Pinned, each worker's process and
every thread it starts stay on its own cores, as each worker would on a GPU of its own; the api (tokenizing,
streaming) runs on the cores left. A worker pins itself first thing, before torch creates its thread pool, whose
threads inherit the mask.
"""
from __future__ import annotations

import logging
import os

from .config import EngineConfig, format_cores

log = logging.getLogger("foresight.placement")


def pin_to_cores(cores: tuple[int, ...], owner: str) -> None:
    """Run this process on `cores`: every thread it has (a mask belongs to a thread, and some start early, e.g.
    the parent watcher) and, inheriting it, every thread it starts later. Nothing when `cores` is empty."""
    if not cores:
        return
    for thread in _thread_ids():
        try:
            os.sched_setaffinity(thread, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    log.info("%s: pinned to core(s) %s", owner, format_cores(cores))


def _thread_ids() -> list[int]:
    """This process's threads (Linux: /proc/self/task), or 0 (the calling thread) where /proc is not there."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_worker(cfg: EngineConfig, owner: str) -> None:
    """Pin the `owner` ("target" or "drafter") worker process to its cores."""
    pin_to_cores(cfg.cores(owner), owner)


def api_cores(cfg: EngineConfig, available: set[int] | None = None) -> tuple[int, ...]:
    """The cores left to the api once the workers' are taken (empty: no worker is pinned, or none is left)."""
    if not cfg.pinned:
        return ()
    available = os.sched_getaffinity(0) if available is None else available
    return tuple(sorted(available - set(cfg.cores("target")) - set(cfg.cores("drafter"))))


def pin_api(cfg: EngineConfig) -> None:
    """The api process onto the cores the workers leave; where they take every core it stays unpinned (it
    mostly waits on sockets)."""
    cores = api_cores(cfg)
    if cfg.pinned and not cores:
        log.info("api: the workers are pinned to every available core; the api is not pinned")
    pin_to_cores(cores, "api")
