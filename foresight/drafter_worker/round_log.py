"""`--round-log FILE`: one JSON line per round that followed a pipelined round, written by the drafter when the
round's outcome arrives. It says what foresight pre-drafted for that outcome and what came, so that the served hit
rate can be taken apart (and set beside the replayed one, `foresight eval-foresight`):

    {"req": "bench-pipelined-3", "round": 7, "block": 7, "realised": [2, 4015], "hit": true, "rank": 0,
     "predicted": [[2, 4015], [0, 13], ...], "job": "done", "foresight_ms": 21.3, "predict_ms": 12.9,
     "draft_ms": 8.1, "budget_ms": 40.2, "verify_ms": 44.8, "passes": 0, "refreshes": 0}

- `block`: drafts in the block that was verified; `realised`: its outcome (drafts accepted, bonus token).
- `predicted`: the outcomes pre-drafted for it, best first (B = its length); `rank`: the realised one's place there
  (null: not pre-drafted); `hit`: its block was served from them.
- `job`: `done` (foresight finished its plan), `cut` (a message from the target ended it between stages: the
  outcome, or another request's), `none` (no foresight ran for this round: the outcome came before the drafter
  reached the job, or the job failed).
- `foresight_ms`: the job's time, of which `predict_ms` the scores (absorbing the round's states, the adapter, the
  decoder) and `draft_ms` selecting the outcomes and drafting them with their passes and refreshes (null: the job
  ended before that stage; a batch of jobs: the batch's); `budget_ms`: the verify time it was planned against;
  `verify_ms`: the target's forward for this block; `passes` / `refreshes`: of the served entry.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class ForesightRun:
    """How one request's foresight for a round went (kept until that round's outcome)."""

    round: int
    cut: bool
    seconds: float
    budget_s: float
    predict_s: float | None  # the stages' times (None: the job ended before the stage)
    draft_s: float | None


@dataclass
class RoundLog:
    path: Path
    runs: dict[str, ForesightRun] = field(default_factory=dict)  # req_id -> its latest foresight

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", buffering=1)  # line-buffered: a killed worker loses at most a line

    def foresight_ran(self, req_id: str, round_: int, cut: bool, seconds: float, budget_s: float,
                      predict_s: float | None = None, draft_s: float | None = None) -> None:
        """Foresight for the outcome of `round_` ran (`cut`: a waiting message ended it)."""
        self.runs[req_id] = ForesightRun(round_, cut, seconds, budget_s, predict_s, draft_s)

    def outcome(self, req_id: str, round_: int, block: int, accepted: int, bonus: int,
                predicted: list[tuple[int, int]], entry, verify_s: float) -> None:
        """The outcome of `round_` arrived (`predicted`: the outcomes pre-drafted for it; `entry`: the one served,
        None on a miss)."""
        run = self.runs.pop(req_id, None)
        ran = run is not None and run.round == round_
        realised = (accepted, bonus)
        self.file.write(json.dumps({
            "req": req_id, "round": round_, "block": block, "realised": list(realised), "hit": entry is not None,
            "rank": predicted.index(realised) if realised in predicted else None,
            "predicted": [list(p) for p in predicted],
            "job": ("cut" if run.cut else "done") if ran else "none",
            "foresight_ms": _ms(run.seconds) if ran else None,
            "predict_ms": _ms(run.predict_s) if ran else None,
            "draft_ms": _ms(run.draft_s) if ran else None,
            "budget_ms": _ms(run.budget_s) if ran else None,
            "verify_ms": _ms(verify_s),
            "passes": entry.passes if entry is not None else None,
            "refreshes": entry.refreshes if entry is not None else None}) + "\n")

    def release(self, req_id: str) -> None:
        self.runs.pop(req_id, None)

    def close(self) -> None:
        self.file.close()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 2)
