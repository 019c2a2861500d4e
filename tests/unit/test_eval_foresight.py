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
    predict = drafter.adapter.predict
    gen = torch.Generator().manual_seed(0)
    drafter.adapter.predict = lambda *a: predict(*a) + 5.0 * torch.randn(predict(*a).shape, generator=gen)
    runner = TargetRunner.for_proposer(target, drafter)
    r = replay(runner, drafter, PROMPTS[0], 30, 6, [], [1, 64])
    assert r["hits"]["eq6"][1] < r["rounds"] and r["hits"]["eq6"][1] <= r["hits"]["eq6"][64]
