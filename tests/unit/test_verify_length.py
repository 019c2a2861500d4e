"""The verify-length controller: cost model, acceptance calibration, the choice, and losslessness
through the round loop (n-gram and a tiny JetSpec drafter, sync mode)."""
from __future__ import annotations

import random

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.drafter_worker.proposer import DraftContext
from foresight.control.costs import CostBySize, fit_line
from foresight.control.verify_length import (
    DRAFT_MARGIN,
    Acceptance,
    VerifyLengthController,
    best_length,
    expected_accepted,
)
from support.inprocess import InProcessEngine
from test_foresight import make_draft_model
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 13, 40], [3, 17, 60, 61, 62]]


def test_expected_accepted_and_line_fit():
    assert expected_accepted([0.5, 0.5]) == [0.0, 0.5, 0.75]
    assert fit_line({4: 2.0}) == (2.0, 0.0)  # one length: flat
    a, b = fit_line({1: 1.0, 3: 2.0, 5: 3.0})
    assert a == pytest.approx(0.5) and b == pytest.approx(0.5)
    assert fit_line({1: 2.0, 5: 1.0}) == (1.5, 0.0)  # a falling cost is noise: flat


def test_cost_model_interpolates_and_tracks():
    cost = CostBySize()
    for _ in range(20):
        cost.observe(1, 1.0)
        cost.observe(7, 2.2)
    est = cost.costs(7)
    assert est[1] == pytest.approx(1.0) and est[7] == pytest.approx(2.2)
    assert est[4] == pytest.approx(1.6)  # interpolated on the line
    assert est[0] == pytest.approx(1.0)  # never extrapolated below the cheapest measurement
    for _ in range(30):  # the context grows: long verifies get dearer
        cost.observe(7, 3.0)
    assert cost.costs(7)[7] == pytest.approx(3.0, rel=0.01)
    assert CostBySize(seconds={3: 2.0}, counts={3: 1}).costs(5) == pytest.approx([2.0] * 6)  # one length: flat


def test_confidence_calibration_converges():
    """The drafter is overconfident: a stated 0.9 is accepted 30% of the time, a stated 0.3 half the time."""
    rng = random.Random(0)
    truth = {0.9: 0.3, 0.3: 0.5}
    model = Acceptance()
    for _ in range(2000):
        conf = [rng.choice(list(truth)) for _ in range(4)]
        accepted = next((i for i, c in enumerate(conf) if rng.random() >= truth[c]), 4)
        model.observe(4, accepted, conf)
    got = model.alphas(2, [0.9, 0.3])
    assert got[0] == pytest.approx(0.3, abs=0.1) and got[1] == pytest.approx(0.5, abs=0.1)


def test_position_rates_without_confidence():
    rng = random.Random(1)
    rates = [0.8, 0.4, 0.4]
    model = Acceptance()
    for _ in range(2000):
        accepted = next((i for i, r in enumerate(rates) if rng.random() >= r), 3)
        model.observe(3, accepted)
    got = model.alphas(5)
    assert got[:3] == pytest.approx(rates, abs=0.1)
    assert 0.3 < got[4] < 0.8  # never tried that deep: the pooled rate


def test_choice_follows_acceptance_and_cost():
    steep = [1.0 + 0.3 * length for length in range(8)]  # 7 drafts cost 3.1x a 0-draft step
    flat = [1.0] * 8
    assert best_length([0.1] * 7, steep) == 1  # low acceptance, steep cost: as short as allowed
    assert best_length([0.1] * 7, steep, min_length=0) == 0
    assert best_length([0.95] * 7, flat) == 7  # high acceptance, flat cost: everything
    assert best_length([0.1] * 7, flat) == 7  # flat cost: more drafts never hurt
    assert 1 < best_length([0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1], steep) < 7
    # A large fixed (drafting) time makes the verify cost matter less: longer blocks.
    assert best_length([0.6] * 7, steep, fixed_s=20.0) > best_length([0.6] * 7, steep)


def test_controller_warms_up_explores_and_truncates():
    ctl = VerifyLengthController(min_rounds=8, explore_every=16)
    assert ctl.choose(7, [], round_=3) == 7  # no data yet: the full block
    for _ in range(10):  # only full blocks verified, mostly rejected at once
        ctl.observe(7, 0, 3.1)
    assert ctl.choose(7, [], round_=3) == 7  # one length measured: the cost line is flat
    assert ctl.choose(7, [], round_=8) == 1  # ... so the shortest length is probed now and then
    for _ in range(10):
        ctl.observe(1, 0, 1.3)
    assert ctl.choose(7, [], round_=3) == 1
    assert ctl.choose(7, [], round_=16) == 7  # exploration keeps long blocks measured
    ctl.observe(0, 0, 0.0)  # the round after the prefill: nothing verified, nothing learnt
    assert ctl.rounds == 20


def test_draft_length_follows_the_chosen_lengths():
    ctl = VerifyLengthController(min_rounds=8, explore_every=16)
    assert ctl.draft_length(15, round_=3) == 15  # warming up: draft everything
    for _ in range(10):
        ctl.observe(15, 0, 3.1)
        ctl.observe(1, 0, 1.3)
    assert ctl.draft_length(15, round_=3) == 15  # no length chosen yet
    assert ctl.choose(15, [], round_=3) == 1
    assert ctl.draft_length(15, round_=4) == 1 + DRAFT_MARGIN
    assert ctl.draft_length(2, round_=4) == 2  # never more than allowed
    assert ctl.draft_length(15, round_=16) == 15  # an exploring round drafts the full block


def test_config_and_cli_flag():
    assert EngineConfig().verify_length == "auto"
    with pytest.raises(ConfigError, match="verify_length"):
        EngineConfig(verify_length="short")
    from foresight.cli import build_parser
    from foresight.config import engine_from_args

    args = build_parser().parse_args(["serve", "--verify-length", "max"])
    assert engine_from_args(args).verify_length == "max"
    args = build_parser().parse_args(["serve", "--verify-length", "prefix"])
    assert engine_from_args(args).verify_length == "prefix"


def test_jetspec_proposer_reports_confidence_and_drops_absorbed_states():
    target = tiny_model("llama")
    proposer = JetSpecProposer(make_draft_model(target), passes=1)
    states = torch.randn(12, proposer.layout.width)
    ctx = DraftContext(req_id="r", tokens=list(range(1, 9)), seed=7, hidden=[states[:7]])
    block = proposer.propose(ctx, 5)
    assert len(block.confidence) == len(block) == 5 and all(0 < c <= 1 for c in block.confidence)
    assert ctx.hidden == []  # absorbed into the context K/V: not kept twice
    ctx.last_block = block
    ctx.absorb(2, 40, states[7:10])
    assert len(ctx.last_block) == 0 and len(ctx.hidden) == 1
    proposer.propose(ctx, 4)
    assert proposer.state(ctx).positions == 10 == len(ctx.tokens) - 1 and ctx.hidden == []


class SteepCost(CostBySize):
    """Verify cost as on CPU in fp32, whatever the tiny model measures: truncation pays off."""

    def costs(self, n: int) -> list[float]:
        return [1.0 + 0.2 * length for length in range(n + 1)]


def make_proposer(drafter: str, model):
    if drafter == "jetspec":  # gives confidences
        return JetSpecProposer(make_draft_model(model), passes=1)
    if drafter == "oracle":  # no confidences, long blocks whose third draft is always wrong
        return OracleForesight(model)
    return None  # n-gram: the tiny models loop on one token, so its blocks are one draft long


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "jetspec"])
def test_auto_verify_length_is_lossless(drafter):
    model = tiny_model("llama")
    proposer = make_proposer(drafter, model)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer)
    worker = engine.drafter
    lengths = worker.lengths[(proposer or worker.proposer).name]  # the controller of mode sync's proposer
    lengths.min_rounds, lengths.explore_every = 2, 5  # truncate early: the requests are short
    lengths.cost = SteepCost()
    choices = []  # (drafts proposed, drafts sent)
    prefix = worker.verify_prefix

    def recording(ctx, draft, draft_s):
        out = prefix(ctx, draft, draft_s)
        choices.append((len(draft), len(out)))
        return out

    worker.verify_prefix = recording
    try:
        for prompt in PROMPTS:
            got = engine.generate(prompt, 40, mode="sync", temperature=0.0)
            assert got["error"] is None
            assert got["tokens"] == plain_greedy(model, prompt, 40, eos=model.config.eos_token_id)
    finally:
        engine.close()
    assert lengths.rounds > 2
    if drafter != "ngram":
        assert any(0 < sent < n for n, sent in choices), "no block was truncated: the test exercised nothing"


def test_skipping_speculation_and_coming_back():
    ctl = VerifyLengthController(min_rounds=8, explore_every=16)
    for _ in range(10):  # drafts almost never accepted; a 2-position verify costs 1.5x a plain step
        ctl.observe(15, 0, 2.0)
        ctl.observe(1, 0, 1.5)
    assert ctl.choose(15, [], round_=3) == 1  # a plain step is not measured yet
    assert ctl.choose(15, [], round_=4) == 0  # ... so it is probed once
    ctl.observe(0, 0, 1.0)
    assert [ctl.choose(15, [], round_=r) for r in (5, 6, 7)] == [0, 0, 0]
    assert ctl.draft_length(15, round_=9) == 0  # no drafting while speculation does not pay
    for _ in range(60):  # the workload changes: drafts are now accepted
        ctl.observe(15, 15, 2.0)
    assert ctl.draft_length(15, round_=16) == 15  # an exploring round drafts the full block ...
    assert ctl.choose(15, [], round_=16) == 15  # ... sends it, and records what it would choose now
    assert ctl.draft_length(15, round_=17) == 15
    assert VerifyLengthController(allow_skip=False).best(3, [], 0.0) >= 1
