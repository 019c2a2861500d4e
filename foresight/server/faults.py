"""The supervisor's bookkeeping, free of processes and sockets: who beat when, and how many restarts
are left. Clocks are injectable so the rules are tested without waiting."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds. A worker that keeps failing faster
    than that will not be fixed by one more restart: the api gives up and exits non-zero, so that
    compose or Kubernetes restarts the whole server (and its operator hears of it)."""

    max_restarts: int
    window_s: float
    clock: Clock = time.monotonic
    _spent: deque = field(default_factory=deque)

    def spend(self) -> bool:
        """Count one restart now; False (nothing counted) when the budget of the window is used up."""
        now = self.clock()
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        if len(self._spent) >= self.max_restarts:
            return False
        self._spent.append(now)
        return True

    @property
    def used(self) -> int:
        return len(self._spent)


@dataclass
class HeartbeatMonitor:
    """The last heartbeat of each watched worker, and what it said about its loop. A worker is watched
    from its ready message on (loading a model may take minutes; the start-up timeout covers that)
    until it is stopped.

    Hung is either of: no beat for `timeout_s` (the process is stopped, frozen or dead), or a loop
    that has not turned for `stall_timeout_s` (stuck in one step; 0 = not judged)."""

    timeout_s: float
    stall_timeout_s: float = 0.0
    clock: Clock = time.monotonic
    _last: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (beat at, stalled_s)

    def watch(self, worker: str) -> None:
        self._last[worker] = (self.clock(), 0.0)

    def beat(self, worker: str, stalled_s: float = 0.0) -> None:
        if worker in self._last:
            self._last[worker] = (self.clock(), stalled_s)

    def forget(self, worker: str) -> None:
        self._last.pop(worker, None)

    def silent_for(self, worker: str) -> float:
        """Seconds since the worker's last beat (0 when it is not watched)."""
        last = self._last.get(worker)
        return 0.0 if last is None else self.clock() - last[0]

    def hung(self, worker: str) -> str | None:
        """Why the worker counts as hung, or None."""
        if worker not in self._last:
            return None
        silent = self.silent_for(worker)
        if silent > self.timeout_s:
            return f"hung: no heartbeat for {silent:.1f} s (process stopped, frozen or dead)"
        stalled = self._last[worker][1] + silent
        if self.stall_timeout_s > 0 and stalled > self.stall_timeout_s:
            return f"hung: its loop has not turned for {stalled:.0f} s (stuck in one step)"
        return None
