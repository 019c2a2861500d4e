"""Mode `auto`: each round of a request runs the strategy with the best measured goodput.

Goodput is committed tokens per second of the round as the request lives it: from the end of its previous
round to this one's commit, less the target's time on other requests meanwhile. So the wait for the drafter's
block, the verification and any drafting the drafter could not hide all count, and the target's own prompt
lookup ("ngram") competes on equal terms.

Estimates. A strategy's estimate for a request pools the request's own recent rounds of it (OWN_DECAY: a long
request's text changes) with the recent rounds of every request of its class (greedy or sampled; POOLED_DECAY),
which weigh at most PRIOR_ROUNDS rounds. Figures are kept per round context ("match" when prompt lookup finds a
long enough match, else "free": lookup and hybrid differ only on rounds without a match), and a context without
figures of a strategy borrows the class's.

Exploring. A strategy no request of the class has measured is tried at once; a rival at r of the best is tried
again after `explore_wait` (EXPLORE_ROUNDS / r**2 of the class's rounds, at most MAX_WAIT), shorter while its
estimate rests on few rounds, longer in proportion when its rounds last longer than the best one's. A trial that
clearly beats the best (PROMISING) runs on, up to MAX_TRIAL rounds. Re-checks of slow-round rivals also wait
while the class's trials have cost more than EXPLORE_SHARE of its time (`exploring_cost`). A pipelined trial runs
two rounds (TRIAL_ROUNDS: its first has no foresight), and the first round of a strategy in a class is never
measured (one-off costs). Only rounds of `auto` requests are measured.

Why each rule is there, with the runs that showed it: docs/journal/2026-12-07-control-layer.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..spec.ngram import lookup
from ..protocol.kinds import Strategy
from .rates import DecayedRate, explore_wait

POOLED_DECAY = 0.95  # per round a strategy runs: the pooled figures follow its last ~20 rounds
# Per round a strategy runs for the request: its own figures follow its last ~10 rounds. Without it a long
# request whose first rounds went well kept a strategy that ran at 0.9x the best for the rest of it
# (measured: fp32 HumanEval T=1; simulated: test_a_long_request_follows_its_own_change).
OWN_DECAY = 0.9
PRIOR_ROUNDS = 8.0  # the pooled estimate weighs at most this many of the request's own rounds
EXPLORE_ROUNDS = 64.0  # rounds between trials of a strategy as good as the best (longer for worse ones)
CONFIDENT_ROUNDS = 8.0  # pooled rounds behind an estimate for its full wait between trials
MAX_WAIT = 400.0  # rounds: even a hopeless strategy is tried again this often (the workload may change)
MAX_TRIAL = 4  # rounds a promising trial may run
PROMISING = 1.1  # a trial round is promising when it beats every other estimate by this factor (not by noise)
# "pipelined" pre-drafts during round t for round t+1: its first round after a switch runs without foresight,
# so its trial lasts two rounds and only rounds after another pipelined one are measured.
TRIAL_ROUNDS = {Strategy.PIPELINED: 2}
MIN_MEASURED = 2  # rounds a strategy must have measured in a class before it competes on its estimate
# Re-checks due of a rival in rounds longer than the best one's wait while the class's re-checks so far cost more
# than this share of its time, net of what they gained (`exploring_cost`); a strategy not measured yet is tried
# regardless, a rival in rounds no longer than the best's on schedule.
EXPLORE_SHARE = 0.01


@dataclass(slots=True)
class RequestChoice:
    """One request's side of the choice: its own measurements and the strategy of its current round."""

    group: str  # the request class whose pooled figures it shares ("greedy" | "sampled")
    current: str
    context: str = ""  # the context of the current round (`round_context`; "": not told)
    previous: str = ""  # the strategy of the round before the current one
    trial_left: int = 0  # further rounds the current trial runs
    trial_rounds: int = 0  # rounds the current trial has run (0: not in a trial)
    trial_due: bool = False  # the current trial re-checks a measured strategy (its cost counts, EXPLORE_SHARE)
    last_rate: float = 0.0  # tokens per second of the last measured round
    measured: dict[tuple[str, str], DecayedRate] = field(default_factory=dict)  # (context, strategy) -> own rounds
    rounds: dict[str, int] = field(default_factory=dict)  # strategy -> rounds run (the usage block)

    @property
    def key(self) -> str:
        """The pooled figures the current round shares: its class's, in its context."""
        return f"{self.group}/{self.context}" if self.context else self.group


class StrategyChooser:
    """Shared by every `auto` request of one target worker."""

    def __init__(self, strategies: Sequence[str]):
        if not strategies:
            raise ValueError("auto needs at least one strategy")
        self.strategies = tuple(strategies)
        self.pooled: dict[str, dict[str, DecayedRate]] = {}  # group -> strategy -> recent rounds of every request
        # The exploring clock is the class's, whatever the context: a trial in either context resets it, so
        # contexts do not double the trials (a pipelined trial pays for the adapter and decoder catching up).
        self.rounds: dict[str, int] = {}  # group -> rounds measured
        self.tried_at: dict[tuple[str, str], int] = {}  # (group, strategy) -> rounds[group] at its last trial
        self.runs: dict[tuple[str, str], int] = {}  # (group, strategy) -> rounds run (measured or not)
        self.measured_n: dict[tuple[str, str], int] = {}  # (group, strategy) -> rounds measured
        # (group, strategy) -> recent rounds run, measured or not (but the first): what a round of it costs
        self.spent: dict[tuple[str, str], DecayedRate] = {}
        self.elapsed_s: dict[str, float] = {}  # group -> seconds of the rounds it was told of
        self.exploring_s: dict[str, float] = {}  # group -> seconds its trials cost beyond the best estimate's pace

    def start(self, group: str, context: str = "") -> RequestChoice:
        """A new request of `group`; its first round's strategy (in `context`) is chosen here."""
        choice = RequestChoice(group=group, current="")
        self.advance(choice, context)
        return choice

    def observe(self, choice: RequestChoice, tokens: int, seconds: float) -> None:
        """The current round committed `tokens` in `seconds` (see the module docstring)."""
        s = choice.current
        choice.rounds[s] = choice.rounds.get(s, 0) + 1
        self._charge(choice, tokens, seconds)
        key = (choice.group, s)  # first rounds, measured counts and round costs: the class's
        self.runs[key] = self.runs.get(key, 0) + 1
        if seconds > 0 and self.runs[key] > 1:
            self.spent.setdefault(key, DecayedRate()).add(tokens, seconds, POOLED_DECAY)
        if s == Strategy.PIPELINED and choice.previous != Strategy.PIPELINED:
            return  # no foresight could run for it: not what pipelined costs or gives
        if seconds <= 0 or self.runs[key] == 1:
            return  # nothing to measure, or the strategy's first round in the class (see the docstring)
        self.measured_n[key] = self.measured_n.get(key, 0) + 1
        choice.last_rate = tokens / seconds
        choice.measured.setdefault((choice.context, s), DecayedRate()).add(tokens, seconds, OWN_DECAY)
        for group in {choice.key, choice.group}:  # the context's figures and the class's
            self.pooled[group][s].add(tokens, seconds, POOLED_DECAY)
        self.rounds[choice.group] += 1

    def observe_held(self, choice: RequestChoice, tokens: int, seconds: float) -> None:
        """A round that ran prompt lookup instead of the current strategy while the drafter caught up for it (the
        round planner's `catch_up_hold`): not a measurement of either, but when the current strategy is on
        trial, what the round lost to the catch-up is the trial's cost."""
        if choice.trial_rounds and choice.trial_due:
            self._charge(choice, tokens, seconds)

    def _charge(self, choice: RequestChoice, tokens: int, seconds: float) -> None:
        """Count a round (`tokens` in `seconds`) into the class's time, and, in the trial of a measured strategy,
        what it took beyond the pace of the best estimate of a strategy other than the one on trial (less: a
        trial that pays earns the next ones their time). The first trials of a strategy not measured yet are
        the one-off price of knowing anything of it and are not counted."""
        group = choice.group
        self.elapsed_s[group] = self.elapsed_s.get(group, 0.0) + max(0.0, seconds)
        if not (choice.trial_rounds and choice.trial_due) or seconds <= 0:
            return
        rates = [r for s, r in self.estimates(choice).items() if s != choice.current and r]
        if rates:
            self.exploring_s[group] = self.exploring_s.get(group, 0.0) + seconds - tokens / max(rates)

    def exploring_cost(self, group: str) -> float:
        """The share of the class's time its trials cost so far, net of what they gained."""
        elapsed = self.elapsed_s.get(group, 0.0)
        return self.exploring_s.get(group, 0.0) / elapsed if elapsed > 0 else 0.0

    def advance(self, choice: RequestChoice, context: str = "") -> str:
        """Choose the strategy of the request's next round, whose context is `context` (it becomes
        `choice.current`)."""
        choice.previous = choice.current
        choice.context = context
        for group in (choice.key, choice.group):
            self.pooled.setdefault(group, {s: DecayedRate() for s in self.strategies})
        self.rounds.setdefault(choice.group, 0)
        rates = self.estimates(choice)
        if choice.trial_rounds and self._trial_goes_on(choice, rates):
            choice.trial_rounds += 1
            return choice.current
        choice.trial_rounds = 0
        untried = [s for s in self.strategies if rates[s] is None or self._untried(choice.group, s)]
        if untried:
            return self._trial(choice, untried[0], due=False)
        best = max(self.strategies, key=lambda s: rates[s])
        due = self._most_overdue(choice, rates, best)
        if due is not None and not self._held_by_share(choice.group, due, best):
            return self._trial(choice, due, due=True)
        choice.current = best
        return best

    def _held_by_share(self, group: str, rival: str, best: str) -> bool:
        """Does the re-check of `rival` wait for the class's exploring share (EXPLORE_SHARE)? Only a rival whose
        rounds last longer than the best one's: a re-check in rounds no longer than the best's costs at most
        what a round of it loses, and when the best estimate is wrong (a strategy with long rounds that looked
        good on a few lucky ones), the re-checks of the cheap rivals are what correct it."""
        return self.exploring_cost(group) > EXPLORE_SHARE and self._round_cost(group, rival, best) > 1.0

    def _untried(self, group: str, strategy: str) -> bool:
        """Measured fewer than MIN_MEASURED times (and not hopelessly unmeasurable: bounded tries)."""
        key = (group, strategy)
        return self.measured_n.get(key, 0) < MIN_MEASURED and self.runs.get(key, 0) < 4 * (MIN_MEASURED + 1)

    def _trial_goes_on(self, choice: RequestChoice, rates: dict[str, float | None]) -> bool:
        """A trial runs its planned rounds, and on (to MAX_TRIAL) while its rounds beat every other estimate."""
        if choice.trial_left > 0:
            choice.trial_left -= 1
            return True
        others = [r for s, r in rates.items() if s != choice.current and r is not None]
        return choice.trial_rounds < MAX_TRIAL and bool(others) and choice.last_rate > PROMISING * max(others)

    def estimates(self, choice: RequestChoice) -> dict[str, float | None]:
        """Tokens per second of each strategy for this request (None: nothing measured yet)."""
        out: dict[str, float | None] = {}
        for s in self.strategies:
            own = choice.measured.get((choice.context, s), DecayedRate())
            pooled = self._pooled(choice, s)
            weight = min(1.0, PRIOR_ROUNDS / pooled.rounds) if pooled.rounds else 0.0
            seconds = own.seconds + weight * pooled.seconds
            out[s] = (own.tokens + weight * pooled.tokens) / seconds if seconds > 0 else None
        return out

    def _most_overdue(self, choice: RequestChoice, rates: dict[str, float | None], best: str) -> str | None:
        """The rival whose trial is most overdue, if any: waits in rounds of the class, by the figures of the
        round's context."""
        now, top = self.rounds[choice.group], rates[best]
        overdue = {}
        for s in self.strategies:
            if s == best:
                continue
            confidence = min(1.0, max(1.0, self._pooled(choice, s).rounds) / CONFIDENT_ROUNDS)
            wait = explore_wait(rates[s], top, EXPLORE_ROUNDS, MAX_WAIT) * confidence
            wait *= self._round_cost(choice.group, s, best)
            age = now - self.tried_at.get((choice.group, s), now)
            if age >= wait:
                overdue[s] = age / wait
        return max(overdue, key=overdue.get) if overdue else None

    def _pooled(self, choice: RequestChoice, strategy: str) -> DecayedRate:
        """The recent rounds of `strategy` pooled over the class's requests in the round's context, or in every
        context while this one has none (a strategy need not be explored again in each context)."""
        pooled = self.pooled[choice.key][strategy]
        return pooled if pooled.rounds or choice.measured.get((choice.context, strategy)) else \
            self.pooled[choice.group][strategy]

    def _round_cost(self, group: str, strategy: str, best: str) -> float:
        """How many of the best strategy's rounds a round of `strategy` lasts (at least 1): the waits between
        trials are in the best one's rounds, so a rival whose rounds are long (pipelined after lookup rounds:
        its adapter and decoder catch up on the whole context) is tried proportionally less often, and
        exploring costs the same share of time whatever the rival. A round's cost is the mean over all its
        recent rounds (`spent`), the unmeasured ones of a trial included."""
        # every measured round is in `spent` too
        mean = {s: self.spent.get((group, s), DecayedRate()).mean_seconds for s in (strategy, best)}
        return max(1.0, mean[strategy] / mean[best]) if mean[best] > 0 else 1.0

    def _trial(self, choice: RequestChoice, strategy: str, due: bool) -> str:
        self.tried_at[(choice.group, strategy)] = self.rounds[choice.group]
        choice.trial_due = due
        choice.current = strategy
        choice.trial_left = TRIAL_ROUNDS.get(strategy, 1) - 1
        choice.trial_rounds = 1
        return strategy


def request_group(temperature: float) -> str:
    """Requests whose acceptance behaves alike share pooled figures."""
    return "greedy" if temperature == 0 else "sampled"


def round_context(tokens: list[int], min_match: int) -> str:
    """A round's context: "match" when prompt lookup finds a match of at least `min_match` tokens (the hybrid
    proposer's threshold) after `tokens` (prompt + output; the last one is the anchor), else "free". One scan
    at n = min_match: a longer match contains one of that length."""
    return "match" if lookup(tokens, 1, min_match, min_match) else "free"
