"""The offline foresight replay (`foresight eval-foresight`) on a tiny Llama.

With the oracle adapter the decoder is perfect, so at temperature 0 the served selection rule names
the realised outcome first in every round (hit rate 1 at B = 1) and the decoder's row 0 always agrees
with the target; with the adapter's predictions corrupted the replay must report misses.
"""
from __future__ import annotations

import torch

from foresight.drafter_worker.calibration import Calibration
from foresight.target_worker.runner import TargetRunner
from foresight.training.eval_foresight import replay
from test_foresight import PROMPTS, make_drafter, sequences, target  # noqa: F401  (fixtures)


def test_perfect_decoder_hits_every_round(target, sequences):
    drafter = make_drafter(target, sequences, passes=0)
    runner = TargetRunner.for_proposer(target, drafter)
    r = replay(runner, drafter, PROMPTS[0], 30, 6, [], [1, 4])
    assert r["rounds"] >= 5 and r["committed"] >= 28  # the prefill gives one token, a draftless step is not replayed
    assert r["hits"] == {"eq6": {1: r["rounds"], 4: r["rounds"]}} and r["anchor_agree"] == r["rounds"]
    assert len(r["predict_s"]) == r["rounds"]


def test_a_calibration_is_replayed_beside_eq6(target, sequences):
    """With a calibration both rules rank every round; one that copies the decoder's acceptance (and beta 1)
    keeps the perfect decoder's greedy path first, so it hits every round too."""
    drafter = make_drafter(target, sequences, passes=0, calibration=Calibration((0, 1, 0, 0, 0, 0), beta=1.0))
    runner = TargetRunner.for_proposer(target, drafter)
    r = replay(runner, drafter, PROMPTS[0], 30, 6, [], [1, 4])
    assert r["hits"] == {rule: {1: r["rounds"], 4: r["rounds"]} for rule in ("eq6", "calibrated")}


def test_noisy_predictions_miss(target, sequences):
    drafter = make_drafter(target, sequences, passes=0)
    predict = drafter.scorer.adapter.predict
    gen = torch.Generator().manual_seed(0)
    drafter.scorer.adapter.predict = lambda *a: predict(*a) + 5.0 * torch.randn(predict(*a).shape, generator=gen)
    runner = TargetRunner.for_proposer(target, drafter)
    r = replay(runner, drafter, PROMPTS[0], 30, 6, [], [1, 64])
    assert r["hits"]["eq6"][1] < r["rounds"] and r["hits"]["eq6"][1] <= r["hits"]["eq6"][64]


def test_a_depth_zero_drafter_replays_and_the_depth_is_chosen_from_measured_times(target, sequences):
    from foresight.drafter_worker.draft_model_scorer import DraftModelScorer
    from foresight.drafter_worker.foresight import ForesightDrafter
    from foresight.training.eval_foresight import recommend_depth
    from test_foresight import make_draft_model

    model = make_draft_model(target)
    drafter = ForesightDrafter(model, DraftModelScorer(model), passes=0)
    r = replay(TargetRunner.for_proposer(target, drafter), drafter, PROMPTS[0], 30, 6, [], [1, 4])
    assert r["rounds"] >= 5 and r["verifies"] >= r["rounds"] and r["verify_s"] > 0
    assert 0 <= r["hits"]["eq6"][1] <= r["hits"]["eq6"][4] <= r["rounds"]

    def row(depth, hit4, predict_ms, verify_ms=40.0):
        return {"decoder_layers": depth, "hit_rate": {"4": hit4}, "predict_ms_p50": predict_ms,
                "verify_ms_mean": verify_ms}

    # the deep decoder hits more but its prediction outlasts the verify: the best of those that fit
    assert recommend_depth([row(0, 0.35, 5.0), row(3, 0.45, 12.0), row(15, 0.72, 55.0)], 4)["decoder_layers"] == 3
    assert recommend_depth([row(0, 0.35, 5.0), row(15, 0.72, 38.0)], 4)["decoder_layers"] == 15  # it fits
    assert recommend_depth([row(3, 0.45, 45.0), row(15, 0.72, 60.0)], 4)["decoder_layers"] == 3  # none fits: cheapest


def test_the_recommended_depth_is_recorded_in_the_adapter_config(tmp_path):
    """`eval-foresight --record` writes the depth into the adapter's config.json, where the server reads its
    default (`adapter_depth`); everything else in the config stays as it was."""
    import json
    import shutil
    from pathlib import Path

    import foresight
    from foresight.drafter_worker.foresight import adapter_depth
    from foresight.training.eval_foresight import record_depth

    shipped = Path(foresight.__file__).parent.parent / "checkpoints" / "smollm2-135m-instruct" / "adapter"
    shutil.copy(shipped / "config.json", tmp_path / "config.json")
    before = json.loads((tmp_path / "config.json").read_text())
    recommended = {"decoder_layers": 0, "cache_size": 4, "why": "test"}
    record_depth(tmp_path, recommended, {"prompts": "chat"})
    assert adapter_depth(tmp_path) == 0
    after = json.loads((tmp_path / "config.json").read_text())
    assert after["extra"]["eval_foresight"] == {"recommended": recommended, "settings": {"prompts": "chat"}}
    assert {k: v for k, v in after.items() if k not in ("decoder_layers", "extra")} == \
        {k: v for k, v in before.items() if k not in ("decoder_layers", "extra")}
    assert {k: v for k, v in after["extra"].items() if k != "eval_foresight"} == before["extra"]
