"""Adding a strategy takes two edits: its `Strategy` member, and its proposer registered in `offered_strategies`.

The test carries that diff for a toy strategy ("recall": what followed the anchor where it last occurred),
applies it to a copy of the package and serves with it in a fresh interpreter: the mode exists, the target asks
the drafter for its blocks, greedy output equals plain greedy decoding (with acceptances and rejections), mode auto
offers it, and the api's metrics count its rounds. Each edit's anchor must occur exactly once in the real source, so the diff stays true."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import foresight

PACKAGE = Path(foresight.__file__).parent
TESTS = Path(__file__).parents[1]

DOCSTRING = ('    """Strategy -> the proposer that drafts it, for every strategy this drafter can run. A new strategy'
             ' is a\n    `Strategy` member and its proposer here (tests/unit/test_new_strategy.py)."""\n')
# (file, text that is there, what replaces it): every place a new strategy touches.
TOY_STRATEGY = [
    ("protocol/kinds.py",
     '    HYBRID = "hybrid"  # prompt lookup on a long match, else the draft model\n',
     '    HYBRID = "hybrid"  # prompt lookup on a long match, else the draft model\n'
     '    RECALL = "recall"  # toy: what followed the anchor where it last occurred\n'),
    ("drafter_worker/strategies.py",  # one hunk: the proposer above the function, its entry in the function
     "def offered_strategies(primary: Proposer, cfg: EngineConfig) -> dict[Strategy, Proposer]:\n" + DOCSTRING
     + "    out: dict[Strategy, Proposer] = {Strategy.SYNC: primary}\n",
     "class RecallProposer:\n"
     "    name = \"recall\"\n\n"
     "    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:\n"
     "        after = [i + 1 for i, t in enumerate(ctx.tokens[:-1]) if t == ctx.tokens[-1]]\n"
     "        return Draft(ctx.tokens[after[-1]:after[-1] + max_drafts] if after else [])\n\n"
     "    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:\n"
     "        return [self.propose(ctx, n) for ctx, n in zip(ctxs, max_drafts)]\n\n\n"
     "def offered_strategies(primary: Proposer, cfg: EngineConfig) -> dict[Strategy, Proposer]:\n" + DOCSTRING
     + "    out: dict[Strategy, Proposer] = {Strategy.SYNC: primary, Strategy.RECALL: RecallProposer()}\n"),
]

SERVE_WITH_IT = r"""
import sys
import foresight
assert foresight.__file__.startswith(sys.argv[1]), foresight.__file__  # the patched copy, not the checkout
from foresight.config import EngineConfig
from foresight.protocol.kinds import Mode, Strategy
from foresight.protocol.messages import RoundStats
from foresight.server.metrics import ServerMetrics
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model

assert Mode.parse("recall", "mode") == Strategy.RECALL
model = tiny_model("llama", varied=True)  # greedy text with cycles: recalled drafts are right there, wrong elsewhere
engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4, verify_length="max"))
try:
    assert "recall" in engine.target.planner.chooser.strategies  # mode auto offers it
    rounds = []
    for prompt in ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [90, 12, 44, 3], [3, 17, 60, 61, 62]):
        want = plain_greedy(model, prompt, 40)
        res = engine.collect([engine.submit(prompt, 40, mode="recall", temperature=0.0)]).popitem()[1]
        assert res["tokens"] == want, (prompt, res["tokens"], want)
        assert {r.strategy for r in res["rounds"]} == {"recall"}  # every round after the prefill: the drafter's
        rounds += res["rounds"]
    drafted = [r for r in rounds if r.drafted]
    assert any(r.accepted > 0 for r in drafted) and any(r.accepted < r.drafted for r in drafted), drafted
finally:
    engine.close()
metrics = ServerMetrics("m")
metrics.record_round(rounds[0])
assert b'strategy="recall"} 1.0' in metrics.render()[0]
print("served", len(rounds), "recall rounds")
"""


def patched_copy(root: Path) -> Path:
    """The package with the toy strategy added, under `root`."""
    shutil.copytree(PACKAGE, root / "foresight", ignore=shutil.ignore_patterns("__pycache__"))
    for name, there, replacement in TOY_STRATEGY:
        path = root / "foresight" / name
        source = path.read_text()
        assert source.count(there) == 1, f"{name}: the anchor of the toy strategy's edit is gone"
        path.write_text(source.replace(there, replacement))
    return root


def test_a_new_strategy_is_two_edits_and_serves(tmp_path):
    assert len(TOY_STRATEGY) <= 3
    root = patched_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{TESTS}"}
    # run in `root`: `python -c` puts the working directory first on the path
    out = subprocess.run([sys.executable, "-c", SERVE_WITH_IT, str(root)], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recall rounds" in out.stdout
