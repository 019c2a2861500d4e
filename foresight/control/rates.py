"""The control layer's estimators and its exploration schedule.

Every figure a controller plans with is one of three things, each forgetting old measurements because
the machine's speed and the workload drift:
    `ema`          a running mean of one cost (the newest measurement weighs COST_EMA);
    `DecayedRate`  tokens, seconds and observations summed with a decay per observation: a goodput
                   (tokens per second) that follows its last ~1 / (1 - decay) observations;
    `LineFit`      a decayed least-squares line, seconds = fixed + per_size * size: what a forward costs
                   by the positions it feeds, or a block by its length.
Each owner chooses its decay by what it follows (named constants beside the owner).

`explore_wait` is the one schedule by which a controller re-tries a rival it does not run: after
`base / r**2` of its own units (rounds, windows), at most `max_wait`, where r is the rival's figure over
the best one's. Close rivals are re-checked often, hopeless ones rarely, so exploring costs at most about
(1 - r) r**2 / base of the controller's time per rival.
"""
from __future__ import annotations

from dataclasses import dataclass

COST_EMA = 0.2  # weight of the newest measurement in a running cost
# Below this variance (relative to the sizes' scale) every observation had one size: no slope is known.
FLAT = 1e-12


def ema(old: float | None, value: float, weight: float = COST_EMA) -> float:
    """The running mean after measuring `value` (old None: nothing measured before)."""
    return value if old is None else old + weight * (value - old)


@dataclass(slots=True)
class DecayedRate:
    """Tokens and seconds of recent observations (rounds, windows), older ones weighing `decay` less each."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0  # observations, decayed alike

    def add(self, tokens: float, seconds: float, decay: float = 1.0) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.rounds = decay * self.rounds + 1.0

    @property
    def rate(self) -> float | None:
        """Tokens per second (None: no time observed)."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def mean_seconds(self) -> float:
        """Seconds per observation (0.0: none)."""
        return self.seconds / self.rounds if self.rounds else 0.0


@dataclass(slots=True)
class LineFit:
    """Weighted least squares of y = a + b x over observations whose weights decay by `decay` per new one."""

    decay: float = 1.0
    sw: float = 0.0  # decayed sums of w, w x, w x^2, w y, w x y
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        d = self.decay
        self.sw = d * self.sw + weight
        self.sx = d * self.sx + weight * x
        self.sxx = d * self.sxx + weight * x * x
        self.sy = d * self.sy + weight * y
        self.sxy = d * self.sxy + weight * x * y

    def fit(self, ridge: float = 0.0) -> tuple[float, float]:
        """(a, b); (0, 0) before any observation. Flat (b = 0, a = the mean) with one size observed, and
        when the slope comes out negative (a larger size is never cheaper: that is noise). `ridge`:
        pseudo-observations pulling the slope toward 0 (with few sizes seen the slope is unknown, not steep)."""
        if self.sw == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x ** 2
        if var <= FLAT * (1.0 + mean_x ** 2):
            return mean_y, 0.0
        slope = (self.sxy / self.sw - mean_x * mean_y) / (var + ridge / self.sw)
        if slope < 0:
            return mean_y, 0.0
        return mean_y - slope * mean_x, slope


def explore_wait(rate: float | None, best: float | None, base: float, max_wait: float) -> float:
    """How long (in the controller's units) to wait before re-trying a rival measured at `rate` while the best
    measured `best`: base / r**2, r = rate / best (at most 1; 1 when either is unknown), at most `max_wait`."""
    ratio = min(1.0, rate / best) if rate is not None and best else 1.0
    return min(max_wait, base / max(ratio, 1e-3) ** 2)
