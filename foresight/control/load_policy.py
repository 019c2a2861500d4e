"""Speculation under load: whether rounds may use the drafter at all while several requests share the target.

A request's own measure of a strategy (`strategy_choice.py`) cannot see what its choice costs the others: on a
CPU a round that waits for the drafter keeps the drafter's core busy, so every batched step runs without the
core it would borrow, and the batch splits into groups that wait for their blocks at different times. So under
load the worker compares three policies on the target's committed tokens per second, all requests together:
    "draft"   each request runs its own strategy (auto's choice, or its fixed mode);
    "lookup"  rounds the target runs alone: auto and ngram requests take prompt lookup, drafting modes plain
              steps (vLLM's `disable_by_batch_size`, decided from measurements);
    "plain"   plain steps for every request.
Throughput is measured over windows of WINDOW_STEPS steps per load level (`load_bucket` of the smoothed running
count: about 2, 4, 8, 16+), the first SETTLE_STEPS after a switch not counted. "plain" runs unless "lookup"
measured LOOKUP_MARGIN better, and either unless "draft" measured DRAFT_MARGIN better (`winner`): plain steps
are safe and a window is noisy. Rivals are re-tried on the `explore_wait` schedule (EXPLORE_WINDOWS / r**2
windows, at most MAX_WAIT). A level seen for the first time starts from what the nearest measured level learnt;
the top levels (6+ requests) try drafting only after a lower level measured it. A lone request, or a batch of
plain requests only, has no policy.

Why each rule is there, with the runs that showed it: docs/journal/2026-12-07-control-layer.md.
"""
from __future__ import annotations

from ..protocol.kinds import Mode, Strategy
from .rates import DecayedRate, explore_wait

POLICIES = ("draft", "lookup", "plain")
TARGET_ALONE = ("lookup", "plain")  # the policies under which no round waits for the drafter
WINDOW_STEPS = 36  # target steps per measured window (request arrivals and prefills make short ones noisy)
DECAY = 0.7  # per window of a policy: its figure follows its last few windows
EXPLORE_WINDOWS = 24.0  # windows between trials of a policy as good as the best (longer for a worse one)
SETTLE_STEPS = 8  # steps after a switch that are not measured (rounds of the old policy still in flight)
MAX_WAIT = 80.0  # windows: even a much worse policy is tried again this often
# Drafting under load must beat the target alone by this factor to run: a switch to it makes the drafter catch
# up on every request (foresight's adapter and decoder take in all the rounds it missed), and a window's
# figure is noisy, so a near tie is not worth those switches.
DRAFT_MARGIN = 1.1
# Prompt lookup under load must beat plain steps by this factor to run (the figures are noisy; plain is safe).
LOOKUP_MARGIN = 1.05
NEW_LEVEL_TRIAL = 3.0  # windows at a new load level before the target-alone policy not inherited is tried
TRIAL_ORDER = ("plain", "lookup", "draft")  # of policies due together, the cheapest trial first


LOAD_DECAY = 0.9  # per step: the load level follows the running requests over the last ~10 steps


TOP_BUCKET = 8  # 6 or more requests: this level and the ones above it (16: 12 or more)


def load_bucket(running: float) -> int:
    """The load level whose figures a window counts toward (0: a lone request, no policy), from the
    smoothed number of running requests: a request that ends and the next that arrives dip it for a step or
    two, which must not start the level's window over. 12 or more requests are a level of their own: a
    batched step there costs much more than at 8 (`scripts/batch_step.py bfloat16 2`, 2-core EPYC: 8
    requests 1.3-1.5x one request's step, 16 1.7-2.3x), so prompt lookup's extra positions that paid at 8
    may not at 16."""
    if running < 1.5:
        return 0
    return 2 if running < 3 else 4 if running < 6 else TOP_BUCKET if running < 12 else 2 * TOP_BUCKET


class LoadPolicy:
    def __init__(self, window_steps: int = WINDOW_STEPS):
        self.window_steps = window_steps
        self.current = "draft"
        self.rates: dict[tuple[int, str], DecayedRate] = {}  # (bucket, policy) -> its recent windows
        self.windows: dict[int, int] = {}  # bucket -> windows measured
        self.tried_at: dict[tuple[int, str], int] = {}  # (bucket, policy) -> windows[bucket] at its last run
        self._bucket, self._steps, self._tokens, self._seconds = 0, 0, 0, 0.0
        self._settling = False  # the window after a switch: not measured
        self._load = 0.0  # running requests, smoothed over steps

    @property
    def level(self) -> int:
        """The load level the current window counts for (0: a lone request, no policy)."""
        return self._bucket

    @property
    def local(self) -> bool:
        """Whether rounds run on the target alone (no round waits for the drafter)."""
        return self.current in TARGET_ALONE

    def held_strategy(self, mode: Mode) -> Strategy:
        """The strategy a round of a request of `mode` runs while the policy holds it to the target alone."""
        return Strategy.NGRAM if self.current == "lookup" and mode in (Mode.AUTO, Mode.NGRAM) else Strategy.AR

    def observe(self, running: int, contested: bool, tokens: int, seconds: float) -> None:
        """One target step (with the idle time before it) committed `tokens` in `seconds` while `running`
        requests were active; `contested`: some of them are not plain requests (else the policies do not differ)."""
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
        if self._steps >= (min(SETTLE_STEPS, self.window_steps) if self._settling else self.window_steps):
            self._end_window(bucket)

    def _end_window(self, bucket: int) -> None:
        if not self._settling and self._seconds > 0:
            self.rates.setdefault((bucket, self.current), DecayedRate()).add(self._tokens, self._seconds, DECAY)
            self.windows[bucket] = self.windows.get(bucket, 0) + 1
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        if self._settling:  # the policy just switched to is measured in the next window
            self._settling = False
            return
        self._switch(self._next(bucket))

    def rate(self, bucket: int, policy: str) -> float | None:
        measured = self.rates.get((bucket, policy))
        return measured.rate if measured is not None else None

    def measured(self, bucket: int) -> dict[str, float]:
        """The figures of the policies measured at this load level."""
        return {p: r for p in POLICIES if (r := self.rate(bucket, p)) is not None}

    def _best(self, bucket: int) -> str:
        """The policy with the best figure at this load; with one unmeasured here, what another level learnt
        (`_inherited`: a new load level starts from what the nearest one learnt) -- unless that runs the
        target alone and both ways of doing so are measured here; else the best measured here, else "draft"
        (at the top level "plain" until `_may_draft_first`)."""
        rates = self.measured(bucket)
        if len(rates) < len(POLICIES):
            inherited = self._inherited(bucket)
            if inherited is not None and (inherited not in TARGET_ALONE
                                          or not all(p in rates for p in TARGET_ALONE)):
                return inherited
        if rates:
            return winner(rates)
        return "draft" if self._may_draft_first(bucket) else "plain"

    def _inherited(self, bucket: int) -> str | None:
        """What another load level learnt: the best at the nearest level where every policy was measured, else
        the best measured so far at the nearest level where any was (a level the load falls to before the
        higher one tried drafting -- the tail of a busy period -- runs what ran there), else None; prompt
        lookup learnt at a lower load is inherited as plain steps."""
        nearest = self._nearest_known(bucket)
        if nearest is not None:
            best = self._best(nearest)
        else:
            measured = [b for b in self.windows if b != bucket and self.measured(b)]
            if not measured:
                return None
            nearest = min(measured, key=lambda b: (abs(b - bucket), -b))
            best = winner(self.measured(nearest))
        # Up to a higher load prompt lookup's extra positions cost more (chat, bf16, 2 cores: auto with lookup in
        # half its rounds 1.08x `ar` at 8 clients; in 98 % of them 0.91x at 16): plain steps, the safe choice,
        # until lookup's trial there.
        return "plain" if best == "lookup" and nearest < bucket else best

    def _may_draft_first(self, bucket: int) -> bool:
        """Whether drafting may be tried at once at a level where it is unmeasured: below the top level, or
        where a lower level has measured it."""
        return bucket < TOP_BUCKET or any(b < bucket and self.rate(b, "draft") is not None for b in self.windows)

    def _nearest_known(self, bucket: int) -> int | None:
        """The nearest other load level where every policy was measured."""
        known = [b for b in self.windows if b != bucket and len(self.measured(b)) == len(POLICIES)]
        return min(known, key=lambda b: abs(b - bucket)) if known else None

    def _next(self, bucket: int) -> str:
        """The policy of the next window: the best, or another one whose turn to be tried again has come
        (the longest untried first)."""
        best = self._best(bucket)
        if self.rate(bucket, best) is None:
            return best  # measure it first
        now = self.windows.get(bucket, 0)
        due = [p for p in POLICIES
               if p != best and now - self.tried_at.get((bucket, p), 0) >= self._wait(bucket, p, best)]
        return min(due, key=lambda p: (self.tried_at.get((bucket, p), 0), TRIAL_ORDER.index(p))) if due else best

    def _wait(self, bucket: int, policy: str, best: str) -> float:
        """Windows between trials of `policy`: longer the worse it measured against `best`. Unmeasured, at
        once, unless another load level already measured every policy: then after NEW_LEVEL_TRIAL windows
        for a way of running the target alone, the usual EXPLORE_WINDOWS for drafting."""
        rate = self.rate(bucket, policy)
        if rate is None:
            if policy == "draft" and not self._may_draft_first(bucket):
                return EXPLORE_WINDOWS
            if self._nearest_known(bucket) is None:
                return 0.0
            return NEW_LEVEL_TRIAL if policy in TARGET_ALONE else EXPLORE_WINDOWS
        return explore_wait(rate, self.rate(bucket, best), EXPLORE_WINDOWS, MAX_WAIT)

    def _switch(self, policy: str) -> None:
        self.tried_at[(self._bucket, policy)] = self.windows.get(self._bucket, 0)
        if policy != self.current:
            self.current = policy
            self._settling = True


def winner(rates: dict[str, float]) -> str:
    """The policy to run from measured figures: plain steps unless prompt lookup measured LOOKUP_MARGIN
    faster, and that unless drafting measured DRAFT_MARGIN faster still."""
    alone = {p: r for p, r in rates.items() if p in TARGET_ALONE}
    if not alone:
        return "draft"
    lookup_leads = "plain" not in alone or alone.get("lookup", 0.0) > LOOKUP_MARGIN * alone["plain"]
    best_alone = "lookup" if lookup_leads else "plain"
    return "draft" if rates.get("draft", 0.0) > DRAFT_MARGIN * alone[best_alone] else best_alone
