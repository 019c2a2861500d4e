"""Speculation under load: whether rounds may use the drafter at all while several requests share the target.

Each request's own measure of a strategy (`strategy_choice.py`) cannot see what its choice costs the others:
on a CPU a round that waits for the drafter keeps the drafter's core busy, so every batched target step
runs without the core it would borrow; and the batch splits into groups that wait for their blocks at
different times. Alone, a request pays for all of this itself and its measure is right; in a batch it is
blind to it, and every request can prefer the drafter while all would be faster without it.

So under load the worker compares two policies on what they are for, the target's committed tokens per
second of wall time, all requests together:
    "draft"  each request runs its own strategy (mode auto's choice, or its fixed mode);
    "local"  rounds the target runs alone: auto requests take the target's prompt lookup, requests of a
             fixed drafting mode take plain steps (speculation off: vLLM's `disable_by_batch_size`,
             decided from measurements instead of a threshold set by hand).
Throughput is measured over windows of WINDOW_STEPS steps, separately per load bucket (the number of
running requests smoothed over steps: about 2, 4 and 8 or more). "local" runs unless "draft" measured
DRAFT_MARGIN better; the other is tried
for a window now and then (more rarely the worse it measured), so a change of load or workload is noticed.
A load level seen for the first time starts with the policy that won at the nearest level already measured.
The window after a switch is not measured: rounds of the old policy are still in flight. A lone request
decides alone (no policy), as does a batch with no request that would draft.
"""
from __future__ import annotations

POLICIES = ("draft", "local")
WINDOW_STEPS = 36  # target steps per measured window (request arrivals and prefills make short ones noisy)
DECAY = 0.7  # per window of a policy: its figure follows its last few windows
EXPLORE_WINDOWS = 12.0  # windows between trials of a policy as good as the best (longer for a worse one)
MAX_WAIT = 80.0  # windows: even a much worse policy is tried again this often
# Drafting under load must beat the target alone by this factor to run: a switch to it makes the drafter catch
# up on every request (foresight's adapter and decoder take in all the rounds it missed), and a window's
# figure is noisy, so a near tie is not worth those switches.
DRAFT_MARGIN = 1.1


LOAD_DECAY = 0.9  # per step: the load level follows the running requests over the last ~10 steps


def load_bucket(running: float) -> int:
    """The load level whose figures a window counts toward (0: a lone request, no policy), from the
    smoothed number of running requests: a request that ends and the next that arrives dip it for a step or
    two, which must not start the level's window over."""
    if running < 1.5:
        return 0
    return 2 if running < 3 else 4 if running < 6 else 8


class LoadPolicy:
    def __init__(self, window_steps: int = WINDOW_STEPS):
        self.window_steps = window_steps
        self.current = "draft"
        self.rates: dict[tuple[int, str], tuple[float, float]] = {}  # (bucket, policy) -> (tokens, seconds)
        self.windows: dict[int, int] = {}  # bucket -> windows measured
        self.tried_at: dict[tuple[int, str], int] = {}  # (bucket, policy) -> windows[bucket] at its last run
        self._bucket, self._steps, self._tokens, self._seconds = 0, 0, 0, 0.0
        self._settling = False  # the window after a switch: not measured
        self._load = 0.0  # running requests, smoothed over steps

    @property
    def local(self) -> bool:
        return self.current == "local"

    def observe(self, running: int, contested: bool, tokens: int, seconds: float) -> None:
        """One target step (with the idle time before it) committed `tokens` in `seconds` while `running`
        requests were active; `contested`: some of them would draft (else the policies do not differ)."""
        if running < 2 or not self._load:  # alone, a request affects no one: at once
            self._load = float(running)
        else:
            self._load = LOAD_DECAY * self._load + (1 - LOAD_DECAY) * running
        bucket = load_bucket(self._load) if contested else 0
        if bucket != self._bucket:  # a new load level: start over; a lone request drafts as it likes
            self._bucket, self._steps, self._tokens, self._seconds = bucket, 0, 0, 0.0
            if bucket == 0:
                self.current = "draft"
            else:
                self._switch(self._best(bucket))
            return
        if bucket == 0:
            return
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        if self._steps >= self.window_steps:
            self._end_window(bucket)

    def _end_window(self, bucket: int) -> None:
        if not self._settling and self._seconds > 0:
            key = (bucket, self.current)
            tokens, seconds = self.rates.get(key, (0.0, 0.0))
            self.rates[key] = (DECAY * tokens + self._tokens, DECAY * seconds + self._seconds)
            self.windows[bucket] = self.windows.get(bucket, 0) + 1
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        if self._settling:  # the policy just switched to is measured in the next window
            self._settling = False
            return
        self._switch(self._next(bucket))

    def rate(self, bucket: int, policy: str) -> float | None:
        tokens, seconds = self.rates.get((bucket, policy), (0.0, 0.0))
        return tokens / seconds if seconds > 0 else None

    def _best(self, bucket: int) -> str:
        """The policy with the better figure at this load; unmeasured here, the better one at the nearest
        load measured (a new load level starts from what the last one learnt), else "draft"."""
        rates = {p: self.rate(bucket, p) for p in POLICIES}
        if all(r is not None for r in rates.values()):
            return "draft" if rates["draft"] > DRAFT_MARGIN * rates["local"] else "local"
        nearest = self._nearest_known(bucket)
        if nearest is not None:
            return self._best(nearest)
        return next((p for p in POLICIES if rates[p] is not None), POLICIES[0])

    def _nearest_known(self, bucket: int) -> int | None:
        """The nearest other load level where both policies were measured."""
        known = [b for b in self.windows if b != bucket and all(self.rate(b, p) is not None for p in POLICIES)]
        return min(known, key=lambda b: abs(b - bucket)) if known else None

    def _next(self, bucket: int) -> str:
        best = self._best(bucket)
        if self.rate(bucket, best) is None:
            return best  # measure it first
        other = next(p for p in POLICIES if p != best)
        if self.rate(bucket, other) is None:  # at once, unless another load level already measured both
            wait = 0.0 if self._nearest_known(bucket) is None else EXPLORE_WINDOWS
        else:
            ratio = min(1.0, self.rate(bucket, other) / self.rate(bucket, best))
            wait = min(MAX_WAIT, EXPLORE_WINDOWS / max(ratio, 1e-3) ** 2)
        now = self.windows.get(bucket, 0)
        if now - self.tried_at.get((bucket, other), 0) >= wait:
            return other
        return best

    def _switch(self, policy: str) -> None:
        self.tried_at[(self._bucket, policy)] = self.windows.get(self._bucket, 0)
        if policy != self.current:
            self.current = policy
            self._settling = True
