"""Foresight at decoder depth 0 (`DraftModelScorer`): the draft model scores the outcomes of the block
under verification itself and drafts each one as a block whose first inputs are the real tokens
y0, d_1..d_k, a. On a tiny Llama with a random (seeded) draft model, float32."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.drafter_worker.draft_model_scorer import DraftModelScorer
from foresight.drafter_worker.foresight import ForesightDrafter
from foresight.drafter_worker.foresight_batch import passes_run
from foresight.drafter_worker.outcomes import outcome_scores, select_outcomes
from foresight.drafter_worker.proposer import DraftContext
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB, plain_greedy, tiny_model
from test_foresight import make_draft_model, true_states

torch.set_num_threads(1)
GAMMA = 5
PROMPT = [3, 17, 60, 61, 62, 11, 12, 13, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def draft_only(model, **kw) -> ForesightDrafter:
    return ForesightDrafter(model, DraftModelScorer(model), **kw)


def drafter_at(target, tokens: list[int], **kw) -> tuple[ForesightDrafter, DraftContext]:
    """A depth-0 drafter holding the true context of tokens[:-1] (the anchor tokens[-1] at position n)."""
    drafter = draft_only(make_draft_model(target), use_budget=False, **kw)
    truth = true_states(target, tokens[:-1], drafter.layout.layers)
    ctx = DraftContext(req_id="r", tokens=list(tokens), seed=3, hidden=[truth])
    drafter.add_request(ctx)
    return drafter, ctx


def fixed_point(model, context, prefix: list[int], m: int) -> list[int]:
    """The m tokens after `prefix` that a block over `context` settles on: each the argmax of the draft
    model's pass over the prefix and the tokens before it (one token at a time, no Jacobi)."""
    tokens = list(prefix)
    for _ in range(m):
        logits = model.block_logits([context], torch.tensor([tokens]))  # [1, L, V']
        tokens.append(int(model.vocab_subset[logits[0, -1].argmax()]))
    return tokens[len(prefix):]


def test_draft_after_prefix_keeps_the_prefix_and_reaches_the_fixed_point(target):
    drafter, ctx = drafter_at(target, PROMPT)
    model, context = drafter.model, drafter.state(ctx).draft
    g = torch.Generator().manual_seed(1)
    noise = torch.randint(0, VOCAB, (3, 4), generator=g)
    # fixed = 1 (the anchor alone) is plain drafting
    anchors = torch.tensor([5, 9, 40])
    plain_ids, plain_probs = model.draft_with_confidence([context] * 3, anchors, noise, passes=2)
    ids, probs = model.draft_after_prefix([context] * 3, torch.cat([anchors[:, None], noise], 1),
                                          torch.ones(3, dtype=torch.long), passes=2)
    assert all(torch.equal(a, b) for a, b in zip(plain_ids, ids))
    assert all(torch.allclose(a, b) for a, b in zip(plain_probs, probs))
    # prefixes of different lengths in one batch, right-padded: each row settles on its own fixed point
    prefixes = [[13, 7], [13, 4, 4, 21], [13]]
    m, width = 4, 4 + 4 - 1
    rows = [torch.tensor(p + noise[b, :m - 1].tolist() + [0] * (width - len(p) - m + 1)) for b, p in enumerate(prefixes)]
    ids, _ = model.draft_after_prefix([context] * 3, torch.stack(rows), torch.tensor([len(p) for p in prefixes]),
                                      passes=width)
    for b, p in enumerate(prefixes):
        f = len(p)
        assert ids[-1][b, f - 1:f - 1 + m].tolist() == fixed_point(model, context, p, m), p


def test_passes_run_counts_the_passes_before_the_block_settled(target):
    """A pass's cost is the draft's time over the passes it ran: an early exit at the fixed point skips the rest."""
    drafter, ctx = drafter_at(target, PROMPT)
    model, context = drafter.model, drafter.state(ctx).draft
    noise = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    inputs = torch.cat([torch.tensor([[5], [9]]), noise], 1)  # [2, 6]: anchor, then J0 noise
    fixed = torch.ones(2, dtype=torch.long)
    ids, _ = model.draft_after_prefix([context] * 2, inputs, fixed, passes=12)
    n = passes_run(ids)
    assert len(ids) == 13 and 1 < n < 13  # a 6-token block settles within 7 passes
    again, _ = model.draft_after_prefix([context] * 2, inputs, fixed, passes=n - 1)
    assert passes_run(again) == n and torch.equal(again[-1], ids[-1])
    assert passes_run(model.draft_after_prefix([context] * 2, inputs, fixed, passes=n - 2)[0]) == n - 1


def test_depth_zero_scores_are_the_draft_models_outcome_law(target):
    """Eq. 6 over the draft model's own rows, P(k, a) under q; each entry's block is the fixed point after
    y0, d_1..d_k, a."""
    drafter, ctx = drafter_at(target, PROMPT, passes=GAMMA, foresight_passes=GAMMA, cache_size=4, temperature=0.0)
    model, state = drafter.model, drafter.state(ctx)
    block = fixed_point(model, state.draft, ctx.tokens[-1:], GAMMA)
    block[3] = (block[3] + 1) % VOCAB  # the draft model's own block, its 4th token changed
    (pred, logits, dec), = drafter.predict_blocks([state], [ctx], [block])
    assert pred is None and dec is None and logits.shape == (GAMMA + 1, VOCAB)
    q = model.block_logits([state.draft], torch.tensor([[ctx.tokens[-1], *block]]))[0]  # [gamma+1, V']
    torch.testing.assert_close(logits[:, model.vocab_subset], q)
    entries = drafter.foresee(ctx, block, GAMMA, budget_s=0.0)
    assert len(entries) == 4 and len({(e.accepted, e.bonus) for e in entries}) == 4
    # Even at T=0 the outcomes follow the temperature-1 law under q (no greedy path first: under q it
    # accepts the draft model's own block), best first.
    law = select_outcomes(outcome_scores(torch.softmax(logits, -1), block), 4)
    assert [(e.accepted, e.bonus) for e in entries] == [(o.k, o.a) for o in law]
    assert [e.score for e in entries] == pytest.approx([o.score for o in law])
    for e in entries:
        prefix = [ctx.tokens[-1], *block[:e.accepted], e.bonus]
        assert list(e.tokens) == fixed_point(model, state.draft, prefix, GAMMA), (e.accepted, e.bonus)
        assert e.refreshes == 0 and len(e.confidence) == GAMMA


def test_pipelined_at_depth_zero_is_lossless_and_consults_the_cache(target):
    seq = PROMPT + plain_greedy(target, PROMPT, 30, eos=target.config.eos_token_id)
    drafter = draft_only(make_draft_model(target), passes=1, cache_size=4)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 30, mode="pipelined", temperature=0.0)
        sampled = engine.generate(PROMPT, 30, mode="pipelined", temperature=1.0, seed=7)
    finally:
        engine.close()
    assert got["error"] is None and got["tokens"] == seq[len(PROMPT):]
    lookups = [r.cache_hit for r in got["rounds"]]
    assert None not in lookups and not lookups[0] and len(lookups) > 2  # every round after the first looks up
    assert drafter.stats.outcomes > 0  # foresight ran and drafted outcomes
    assert sampled["error"] is None and len(sampled["tokens"]) == 30


def test_make_proposer_builds_depth_zero_without_an_adapter(tmp_path):
    from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
    from foresight.drafter_worker.worker import make_proposer, why_no_foresight
    from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights
    from support.tiny_models import save_tiny_model

    target_dir = save_tiny_model("llama", tmp_path)
    target = tiny_model("llama")
    DraftModel(DraftConfig.for_target(target.config, num_layers=1),
               SharedWeights.from_target(target)).save(tmp_path / "drafter")
    cfg = EngineConfig(target=str(target_dir), drafter=str(tmp_path / "drafter"),
                       drafter_compile="off")  # what is built, not how fast (tests/unit/test_compiled_draft.py)
    assert type(make_proposer(cfg)) is JetSpecProposer and why_no_foresight(cfg)  # no adapter: sync only
    depth0 = dataclasses.replace(cfg, decoder_layers=0)
    proposer = make_proposer(depth0)
    assert isinstance(proposer.scorer, DraftModelScorer) and proposer.supports_foresight and proposer.decoder_layers == 0
    assert why_no_foresight(depth0) is None
    assert list(proposer.layout.layers) == sorted(proposer.model.config.target_layers)
    with pytest.raises(ConfigError, match="decoder_layers"):
        EngineConfig(decoder_layers=-1)
    # an adapter whose training recorded depth 0 (eval-foresight's choice) serves depth 0 by default
    from foresight.models.adapter import Adapter

    adapter = Adapter.from_target(target, target_indices=[1])
    adapter.config.decoder_layers = 0
    adapter.save(tmp_path / "drafter" / "adapter")
    assert isinstance(make_proposer(cfg).scorer, DraftModelScorer)
    assert not isinstance(make_proposer(dataclasses.replace(cfg, decoder_layers=2)).scorer, DraftModelScorer)
