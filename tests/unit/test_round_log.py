"""`--round-log`: a line per round after a pipelined one, agreeing with what the target was served."""
from __future__ import annotations

import json

import torch

from foresight.config import EngineConfig
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]


def test_the_round_log_takes_the_served_hit_rate_apart(tmp_path):
    model = tiny_model("llama", varied=True)
    path = tmp_path / "logs" / "rounds.jsonl"
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=5, round_log=str(path)),
                             proposer=OracleForesight(model, cuts=3), foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 40, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    served = [r.cache_hit for r in got["rounds"] if r.cache_hit is not None]
    # The first pipelined round follows the prompt (nothing foreseen, no line); each later one has its line.
    assert len(lines) > 3 and [line["hit"] for line in lines] == served[1:]
    assert [line["round"] for line in lines] == sorted({line["round"] for line in lines})
    assert any(line["hit"] for line in lines) and any(line["job"] == "done" for line in lines)
    for line in lines:
        assert line["req"].startswith("t-") and 0 <= line["realised"][0] <= line["block"] <= 4
        assert line["job"] in ("done", "none")  # nothing cuts a job here (foresight runs to completion)
        if line["job"] == "done":  # a finished job served the outcome exactly when it had foreseen it
            assert line["hit"] == (line["rank"] is not None) and line["foresight_ms"] > 0
            assert 0 < len(line["predicted"]) <= 4
        if line["hit"]:
            assert line["predicted"][line["rank"]] == line["realised"] and line["passes"] is not None
