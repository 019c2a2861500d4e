"""Foresight drafting (JetSpec++ section 4.2) with a perfect (oracle) adapter on a tiny Llama.

The oracle adapter returns the target's TRUE states of the block, and the decoder fed true states is
the perfect decoder, so at temperature 0 foresight must name the realised outcome of every block, and
the block it pre-drafts for that outcome must be what drafting from the verified context would give.
Batched drafting must keep each outcome's context to its own row, and the pipelined engine must stay
lossless while answering most rounds from the speculation cache.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from foresight.config import EngineConfig
from foresight.models.decoder import ForesightDecoder
from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights
from foresight.drafter_worker.calibration import Calibration
from foresight.drafter_worker import decoder_scorer
from foresight.drafter_worker.decoder_scorer import AdapterDecoderScorer
from foresight.drafter_worker.foresight import ForesightDrafter
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.drafter_worker.proposer import Draft, DraftContext
from support.inprocess import InProcessEngine
from support.oracle_adapter import OracleAdapter
from support.tiny_models import VOCAB, plain_greedy, tiny_model

torch.set_num_threads(1)
GAMMA = 5  # drafts per block
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 17, 60, 61, 62, 11, 12, 13]]
NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")  # 3 layers: draft model reads indices [1, 3]


@pytest.fixture(scope="module")
def sequences(target):
    return [p + plain_greedy(target, p, NEW, eos=target.config.eos_token_id) for p in PROMPTS]


def make_draft_model(target, seed: int = 0) -> DraftModel:
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(target.config, num_layers=2, block_size=8, context_window=24)
    model = DraftModel(cfg, SharedWeights.from_target(target)).eval()
    with torch.no_grad():  # random init is near-uniform; make outputs depend visibly on the inputs
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(20.0)
    return model


def make_drafter(target, sequences, passes: int = 1, **kw) -> ForesightDrafter:
    decoder = ForesightDecoder(target, 2)  # top 2 layers: input index 1
    adapter = OracleAdapter(target, [1], sequences)
    model = make_draft_model(target)
    return ForesightDrafter(model, AdapterDecoderScorer(model, adapter, decoder), passes=passes, **kw)


@torch.inference_mode()
def true_states(target, tokens: list[int], indices: list[int]) -> torch.Tensor:
    out = target(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in indices], dim=-1)


@torch.inference_mode()
def greedy_outcome(target, tokens: list[int], block: list[int]) -> tuple[int, int]:
    """The verification outcome (k, a) of `block` after `tokens` at temperature 0, from the target."""
    top = target(torch.tensor([tokens + block])).logits[0, len(tokens) - 1:].argmax(-1).tolist()
    k = next((i for i, d in enumerate(block) if top[i] != d), len(block))
    return k, top[k]


def test_construction_checks_and_layout(target, sequences):
    model = make_draft_model(target)
    drafter = make_drafter(target, sequences)
    assert drafter.supports_foresight and not JetSpecProposer(model).supports_foresight
    assert model.config.target_layers == [1, 3] and drafter.layout.layers == (1, 3)
    wide = AdapterDecoderScorer(model, OracleAdapter(target, [1, 2], sequences), ForesightDecoder(target, 1))
    assert wide.layout.layers == (1, 2, 3)
    with pytest.raises(ValueError, match="must also predict index 2"):  # decoder reads 2, adapter predicts 1
        AdapterDecoderScorer(model, OracleAdapter(target, [1], sequences), ForesightDecoder(target, 1))
    with pytest.raises(ValueError, match=r"\[1\] are neither predicted"):  # draft model reads index 1
        AdapterDecoderScorer(model, OracleAdapter(target, [2], sequences), ForesightDecoder(target, 1))
    with pytest.raises(ValueError, match="adapter and a decoder"):
        AdapterDecoderScorer(model, None, ForesightDecoder(target, 1))


def test_deeper_decoder_drops_adapter_stages_and_feeds_the_draft_model(target, sequences):
    """A decoder starting below the adapter's deepest index: the adapter keeps only the stages up to the
    decoder's input, and the draft model reads the decoder's pass-through states above it (here index 2
    and the final-normed 3), which with true inputs are the target's own."""
    torch.manual_seed(0)
    cfg = DraftConfig.for_target(target.config, target_layers=[1, 2, 3], num_layers=1, block_size=8)
    model = DraftModel(cfg, SharedWeights.from_target(target)).eval()
    drafter = ForesightDrafter(model, AdapterDecoderScorer(model, OracleAdapter(target, [1, 2], sequences),
                                                           ForesightDecoder(target, 2)))
    assert drafter.scorer.adapter.target_indices == [1] and drafter.scorer.adapter_indices == [1]
    assert drafter.layout.layers == (1, 2, 3) and drafter.scorer.decoder.input_index == 1
    seq, p = sequences[0], len(PROMPTS[0])
    truth = true_states(target, seq, [1, 2, 3])
    ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=0, hidden=[truth[:p]])
    pred, _, dec_states = drafter.predict(ctx, seq[p + 1:p + 4])  # the true continuation as the block
    torch.testing.assert_close(drafter.scorer.draft_states(pred, dec_states), truth[p:p + 4], atol=1e-4, rtol=0)


def test_pipelined_miss_drafts_before_the_adapter_and_decoder_absorb(target, sequences):
    """The fallback draft of a pipelined miss extends only the draft model's context (the target waits
    for it); foresight absorbs the same states into the adapter and decoder afterwards."""
    drafter = make_drafter(target, sequences)
    seq, p = sequences[0], len(PROMPTS[0])
    truth = true_states(target, seq, drafter.layout.layers)
    ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=0, hidden=[truth[:p]], pipelined=True)
    block = drafter.propose(ctx, GAMMA).tokens
    state = drafter.state(ctx)
    assert (state.model.positions, state.scored, len(state.unscored)) == (p, 0, 1)
    drafter.foresee(ctx, block, GAMMA, budget_s=0.0)
    assert (state.model.positions, state.scored, state.unscored) == (p, p, [])


def test_a_catch_up_runs_adapter_and_decoder_in_passes_that_pause(target, sequences, monkeypatch):
    """`catch_up` (mode auto before a switch to pipelined) takes the committed states into the adapter and
    decoder CATCH_UP_ROWS positions a pass, pauses when `stop()` is true, and leaves them exactly as one
    prediction that took all of them at once."""
    monkeypatch.setattr(decoder_scorer, "CATCH_UP_ROWS", 5)
    seq, p = sequences[0], len(PROMPTS[0])  # 12 prompt positions: passes of 5, 5 and 2
    truth = true_states(target, seq, make_drafter(target, sequences).layout.layers)

    def context() -> DraftContext:
        return DraftContext(req_id="r", tokens=seq[:p + 1], seed=0, hidden=[truth[:p]], pipelined=True)

    caught, ctx = make_drafter(target, sequences), context()
    asked = []
    assert not caught.catch_up(ctx, lambda: asked.append(1) or len(asked) == 2)  # a message before pass 2
    state = caught.state(ctx)
    assert (state.model.positions, state.scored, state.decoder.length) == (p, 5, 0)
    assert caught.catch_up(ctx, lambda: False)
    assert (state.scored, state.decoder.length, state.unscored, state.decoder_new) == (p, p, [], [])
    block = seq[p + 1:p + 1 + GAMMA]
    at_once = make_drafter(target, sequences)
    for got, want in zip(caught.predict(ctx, block), at_once.predict(context(), block)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_foresight_job_catches_up_in_passes_a_message_stops(target, sequences, monkeypatch):
    """A request's first foresight job, whose decoder lacks the prompt, catches up in passes first: a message
    that arrives meanwhile ends the job after its pass, with nothing pre-drafted (the target never waits for
    the whole catch-up); the next job goes on from there and pre-drafts what an uninterrupted one would."""
    monkeypatch.setattr(decoder_scorer, "CATCH_UP_ROWS", 4)
    seq, p = sequences[0], len(PROMPTS[0])  # 12 prompt positions: three passes
    truth = true_states(target, seq, make_drafter(target, sequences).layout.layers)

    def started() -> tuple[ForesightDrafter, DraftContext, list[int]]:
        drafter = make_drafter(target, sequences)
        ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=0, hidden=[truth[:p]], pipelined=True)
        return drafter, ctx, drafter.propose(ctx, GAMMA).tokens

    drafter, ctx, block = started()
    asked = []
    assert drafter.foresee(ctx, block, GAMMA, budget_s=0.0, stop=lambda: asked.append(1) or len(asked) > 1) == []
    state = drafter.state(ctx)
    assert (state.scored, state.decoder.length) == (4, 0)  # one adapter pass, then the message
    got = drafter.foresee(ctx, block, GAMMA, budget_s=0.0)
    assert state.decoder.length == p and got
    other, other_ctx, other_block = started()
    assert other_block == block
    want = other.foresee(other_ctx, block, GAMMA, budget_s=0.0)
    assert [(e.accepted, e.bonus, e.tokens) for e in got] == [(e.accepted, e.bonus, e.tokens) for e in want]


def test_the_catch_up_is_not_counted_as_the_prediction_cost(target, sequences, monkeypatch):
    """The budget plans with what predicting a block costs; a new prompt's catch-up is a one-off and stays
    out of that estimate (a clock that only the catch-up moves)."""
    from foresight.drafter_worker import foresight_batch

    clock = [0.0]
    monkeypatch.setattr(foresight_batch, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(decoder_scorer, "CATCH_UP_ROWS", 4)
    drafter = make_drafter(target, sequences)
    catch_up = drafter.catch_up

    def slow_catch_up(ctx, stop) -> bool:
        clock[0] += 100.0
        return catch_up(ctx, stop)

    drafter.catch_up = slow_catch_up
    seq, p = sequences[0], len(PROMPTS[0])
    truth = true_states(target, seq, drafter.layout.layers)
    ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=0, hidden=[truth[:p]], pipelined=True)
    assert drafter.foresee(ctx, drafter.propose(ctx, GAMMA).tokens, GAMMA, budget_s=0.0)
    assert clock[0] == 100.0 and drafter.costs.predict.count == 1 and drafter.costs.predict_s == 0.0


def test_plan_uses_the_caps_and_the_measured_costs(target, sequences):
    """The round's plan: caps without a budget or a measurement; else Eq. 3 (tested in test_refinement.py)."""
    drafter = make_drafter(target, sequences, cache_size=6, foresight_passes=3, refreshes=2)
    assert (drafter.plan(0.0, "anchor").outcomes, drafter.plan(0.0, "anchor").passes) == (6, 3)
    assert drafter.plan(0.0, "anchor").refreshes == 2 and drafter.plan(0.0, "none").refreshes == 0
    drafter.costs.predict.observe(0.003)
    for rows in range(1, 7):  # one batched pass: 1 ms per row
        drafter.costs.passes.observe(rows, 0.001 * rows)
    assert drafter.plan(0.010, "none").outcomes == 6 and drafter.plan(0.010, "none").passes == 0  # (10-3)/1 ms
    assert drafter.plan(0.001, "anchor").outcomes == 1  # never fewer than one
    drafter.use_budget = False
    assert drafter.plan(0.001, "anchor").outcomes == 6


def test_perfect_foresight_names_and_predrafts_the_realised_outcome(target, sequences):
    """(a) With the oracle adapter and the decoder, the top outcome at temperature 0 is the realised
    greedy outcome in every round; its pre-drafted block (run to the Jacobi fixed point, which does not
    depend on the noise) equals the block drafted from the true verified context after that outcome."""
    drafter = make_drafter(target, sequences, passes=GAMMA, foresight_passes=GAMMA, cache_size=4,
                           temperature=0.0, refinement="none")  # refinement would edit the blocks
    seq = sequences[0]
    p = len(PROMPTS[0])
    truth = true_states(target, seq, drafter.layout.layers)
    ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=3, hidden=[truth[:p]])
    ks, costs = [], []
    for r in range(10):
        n = len(ctx.tokens) - 1
        if n + 1 + GAMMA >= len(seq):
            break
        block = seq[n + 1:n + 1 + GAMMA]
        c = r % (GAMMA + 1)  # corrupt one draft (none when c == GAMMA): outcomes vary
        if c < GAMMA:
            block[c] = (block[c] + 1) % VOCAB
        k, a = greedy_outcome(target, ctx.tokens, block)
        ctx.last_block = Draft(block)
        entries = drafter.foresee(ctx, block, GAMMA, budget_s=0.0)
        costs.append(drafter.stats.total_s)
        assert len(entries) == 4 and len({(e.accepted, e.bonus) for e in entries}) == 4
        assert (entries[0].accepted, entries[0].bonus) == (k, a), f"round {r}"
        assert all(len(e.tokens) == GAMMA and e.passes == GAMMA for e in entries)
        ctx.absorb(k, a, truth[n:n + k + 1])  # the target sends the anchor's and accepted drafts' states
        assert ctx.tokens == seq[:len(ctx.tokens)]
        assert list(entries[0].tokens) == drafter.propose(ctx, GAMMA).tokens  # sync mode: J0 + GAMMA passes
        ks.append(k)
    assert len(ks) >= 6 and len(set(ks)) >= 4  # several different outcomes were foreseen
    assert drafter.scorer.adapter.predict_calls == len(ks)
    print(f"\nforesight per round (B=4, J={GAMMA}, gamma={GAMMA}): median {sorted(costs)[len(costs) // 2] * 1e3:.1f} ms")


def test_batched_outcomes_equal_one_at_a_time(target, sequences):
    """(c) Drafting B outcomes in one batch (per-row contexts of different lengths, left-padded)
    equals drafting each outcome alone."""
    drafter = make_drafter(target, sequences)
    seq = sequences[1]
    p = len(PROMPTS[1])
    truth = true_states(target, seq, drafter.layout.layers)
    ctx = DraftContext(req_id="r", tokens=seq[:p + 1], seed=3, hidden=[truth[:p]])
    state = drafter.absorb(ctx)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(GAMMA + 1, truth.shape[1], generator=g) * 3  # predicted states of n..n+gamma
    outcomes = [(0, 7), (3, 9), (GAMMA, 11), (2, 7), (3, 40)]
    noise = torch.randint(0, VOCAB, (len(outcomes), GAMMA - 1), generator=g)
    batched, _ = drafter.scorer.draft_outcomes(state, p, states, outcomes, noise, passes=2)
    for b, o in enumerate(outcomes):
        alone, _ = drafter.scorer.draft_outcomes(state, p, states, [o], noise[b:b + 1], passes=2)
        assert torch.equal(batched[b], alone[0]), o
    assert len({tuple(row) for row in batched.tolist()}) == len(outcomes)  # the rows really differ
    # The rows read different contexts: the same anchor and noise after another k drafts differently.
    other, _ = drafter.scorer.draft_outcomes(state, p, states, [(GAMMA, 9)], noise[1:2], passes=2)
    assert not torch.equal(other[0], batched[1])


def test_pipelined_engine_is_lossless_and_hits_the_cache(target, sequences):
    """(b) End to end through the round protocol: greedy output equals plain greedy decoding, every
    round after the first consults the cache, and the perfect foresight hits it."""
    drafter = make_drafter(target, sequences, passes=1, cache_size=4, temperature=0.0)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    hits = rounds = 0
    try:
        for prompt, seq in zip(PROMPTS, sequences):
            got = engine.generate(prompt, NEW, mode="pipelined", temperature=0.0)
            assert got["error"] is None
            assert got["tokens"] == seq[len(prompt):]
            lookups = [r.cache_hit for r in got["rounds"]]
            assert None not in lookups and not lookups[0]  # round 1 follows the prefill
            assert sum(r.drafted for r in got["rounds"]) > 0
            hits += sum(lookups[1:])
            rounds += len(lookups) - 1
    finally:
        engine.close()
    assert hits > 0
    print(f"\ncache hit rate at T=0 with the oracle adapter: {hits}/{rounds} = {hits / rounds:.2f}")


def test_make_proposer_picks_foresight_when_an_adapter_ships_beside_the_drafter(tmp_path):
    """Checkpoint folders -> the right proposer: draft model alone = sync only; with adapter/ = foresight."""
    import dataclasses

    from foresight.config import ConfigError, EngineConfig
    from foresight.models.adapter import Adapter
    from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights
    from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
    from foresight.drafter_worker.worker import make_proposer
    from support.tiny_models import save_tiny_model, tiny_model

    target_dir = save_tiny_model("llama", tmp_path)
    target = tiny_model("llama")
    n = target.config.num_hidden_layers
    draft = DraftModel(DraftConfig.for_target(target.config, target_layers=[1, 2, n], num_layers=1),
                       SharedWeights.from_target(target))
    draft.save(tmp_path / "drafter")
    cfg = EngineConfig(target=str(target_dir), drafter=str(tmp_path / "drafter"),
                       drafter_compile="off")  # what is built, not how fast (tests/unit/test_compiled_draft.py)
    sync_only = make_proposer(cfg)
    assert type(sync_only) is JetSpecProposer and not sync_only.supports_foresight
    Adapter.from_target(target, target_indices=[1, 2]).save(tmp_path / "drafter" / "adapter")
    with_foresight = make_proposer(cfg)
    assert with_foresight.supports_foresight and with_foresight.scorer.decoder.input_index == 2
    deeper = make_proposer(dataclasses.replace(cfg, decoder_layers=n - 1))  # input index 1: adapter keeps [1]
    assert deeper.scorer.decoder.input_index == 1 and deeper.scorer.adapter.target_indices == [1]
    with pytest.raises(ConfigError, match="decoder_layers"):  # input index 0 is not predicted
        make_proposer(dataclasses.replace(cfg, decoder_layers=n))
    assert not make_proposer(dataclasses.replace(cfg, adapter="none")).supports_foresight
    assert with_foresight.calibration is None  # none fit for this adapter: Eq. 6 scores
    fit = Calibration((0.1, 0.2, 0.3, 0.4, 0.5, 0.6), beta=0.9, source="test fit")
    fit.save(tmp_path / "drafter" / "adapter" / "calibration.json")
    assert make_proposer(cfg).calibration == fit  # "auto": the one beside the adapter
    assert make_proposer(dataclasses.replace(cfg, calibration="none")).calibration is None
    with pytest.raises(ConfigError, match="calibration: .* does not exist"):
        make_proposer(dataclasses.replace(cfg, calibration=str(tmp_path / "missing.json")))


def test_select_scores_under_the_requests_sampling(target, sequences):
    """Foresight picks outcomes as the request verifies: never a token top-k removes; under nucleus
    verification no outcome that rejects a draft inside the nucleus, and a greedy path through it."""
    from foresight.protocol.messages import SamplingParams

    drafter = make_drafter(target, sequences)
    logits = torch.randn(3, target.config.vocab_size, generator=torch.Generator().manual_seed(3)) * 2
    block = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # d_1: the runner-up
    top2 = logits.topk(2, dim=-1).indices
    picked = drafter.select(logits, block, 50, 1.0, SamplingParams(temperature=1.0, top_k=2))
    assert picked and all(o.a in top2[o.k].tolist() for o in picked)
    assert len(drafter.select(logits, block, 50, 1.0)) > len(picked)  # without top-k: more outcomes
    wide = SamplingParams(temperature=1.0, verification="nucleus", nucleus_threshold=0.999)
    assert {o.k for o in drafter.select(logits, block, 50, 1.0, wide)} == {len(block)}
    greedy = SamplingParams(temperature=0.0, verification="nucleus", nucleus_threshold=0.999)
    first = drafter.select(logits, block, 4, 0.0, greedy)[0]
    assert (first.k, first.a) == (len(block), int(logits[2].argmax()))
    exact = drafter.select(logits, block, 4, 0.0, SamplingParams(temperature=0.0))[0]
    assert (exact.k, exact.a) == (0, int(logits[0].argmax()))  # exact greedy rejects the runner-up


def test_a_calibration_reranks_the_outcomes(target, sequences):
    """With a calibration the calibrated scores rank the cache: weights that make every draft near-surely
    rejected put the outcomes at k = 0 first; `calibrated=False` keeps Eq. 6 (as the replay compares)."""
    pessimist = Calibration((0.0, 0.0, 0.0, 0.0, 0.0, -8.0), beta=1.0)
    drafter = make_drafter(target, sequences, calibration=pessimist)
    logits = torch.randn(4, target.config.vocab_size, generator=torch.Generator().manual_seed(5)) * 8  # peaked
    block = logits[:3].argmax(-1).tolist()  # every draft the decoder's top token: Eq. 6 favours long outcomes
    calibrated = drafter.select(logits, block, 4, 1.0, confidence=[0.9, 0.9, 0.9])
    assert {o.k for o in calibrated} == {0}
    eq6 = drafter.select(logits, block, 4, 1.0, calibrated=False)
    assert eq6 != calibrated and any(o.k > 0 for o in eq6)
