"""The JetSpec draft model and its proposer on tiny random models: shapes, causality, Jacobi fixed
points, batching, checkpoints, and lossless speculative decoding through the round loop."""
from __future__ import annotations

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights, default_target_layers, is_checkpoint
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer, resolve_drafter_path
from foresight.drafter_worker.proposer import Draft, DraftContext
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB, plain_greedy, save_tiny_model, tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def make_drafter(target, seed: int = 0, subset: torch.Tensor | None = None, **kw) -> DraftModel:
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(target.config, **{"num_layers": 2, "block_size": 8, "context_window": 24, **kw})
    model = DraftModel(cfg, SharedWeights.from_target(target), subset).eval()
    with torch.no_grad():  # random init is near-uniform; make outputs depend visibly on the inputs
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(20.0)
    return model


def states_for(model: DraftModel, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(model.config.target_layers) * model.config.target_hidden_size, generator=g) * 5


def one_block(model: DraftModel, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states [n, H] of one block (tokens [n]) after the context `states` (training path)."""
    t, n = states.shape[0], tokens.shape[0]
    mask = torch.cat([torch.ones(n, t, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=-1)
    with torch.no_grad():
        return model.forward_blocks(states[None], torch.arange(t)[None], tokens[None], torch.arange(n)[None],
                                    t + torch.arange(n)[None], torch.full((1, n), t - 1), mask[None])[0]


def test_default_layers():
    assert default_target_layers(30) == [3, 15, 27, 30]
    assert default_target_layers(3) == [1, 3]


def test_shapes_and_vocab_subset(target):
    subset = torch.arange(10, 70)
    model = make_drafter(target, subset=subset)
    assert model.config.vocab_subset_size == 60
    ctxs = [model.encode_context(states_for(model, 12)), model.encode_context(states_for(model, 5, seed=2))]
    noise = torch.randint(0, VOCAB, (2, 6))
    outs = model.draft(ctxs, torch.tensor([3, 4]), noise, passes=2)
    assert len(outs) == 3 and all(o.shape == (2, 7) for o in outs)
    assert all(((o >= 10) & (o < 70)).all() for o in outs)  # mapped back to full-vocabulary ids
    hidden = one_block(model, states_for(model, 12), torch.randint(0, VOCAB, (8,)))
    assert hidden.shape == (8, model.config.hidden_size)
    assert model.logits(hidden).shape == (8, 60)


def test_block_is_causal(target):
    model = make_drafter(target)
    states = states_for(model, 10)
    tokens = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(3))
    base = one_block(model, states, tokens)
    for j in (1, 4, 7):
        changed = tokens.clone()
        changed[j] = (changed[j] + 1) % VOCAB
        out = one_block(model, states, changed)
        torch.testing.assert_close(out[:j], base[:j], rtol=0, atol=1e-6)
        assert not torch.allclose(out[j:], base[j:])


def test_blocks_of_one_sequence_do_not_see_each_other(target):
    model = make_drafter(target)
    states, n, t = states_for(model, 20), 8, 20
    anchors = [9, 15]
    tokens = torch.randint(0, VOCAB, (1, 2 * n), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, 2 * n, t + 2 * n, dtype=torch.bool)
    for a, pos in enumerate(anchors):
        mask[0, a * n:(a + 1) * n, :pos] = True
        mask[0, a * n:(a + 1) * n, t + a * n:t + (a + 1) * n] = torch.ones(n, n, dtype=torch.bool).tril()
    args = dict(ctx_states=states[None], ctx_positions=torch.arange(t)[None], block_idx=torch.arange(n).repeat(2)[None],
                positions=torch.tensor([[p + i for p in anchors for i in range(n)]]),
                anchor_index=torch.tensor([[p - 1 for p in anchors for _ in range(n)]]), mask=mask)
    with torch.no_grad():
        base = model.forward_blocks(tokens=tokens, **args)
        changed = tokens.clone()
        changed[0, n:] = (changed[0, n:] + 1) % VOCAB  # only the second block's inputs
        out = model.forward_blocks(tokens=changed, **args)
        # the first block alone, with its own context only: the same as inside the group
        alone = one_block(model, states[:anchors[0]], tokens[0, :n])
    torch.testing.assert_close(out[0, :n], base[0, :n], rtol=0, atol=1e-6)
    torch.testing.assert_close(alone, base[0, :n], rtol=1e-5, atol=1e-5)


def test_incremental_context_equals_full_encoding(target):
    model = make_drafter(target, context_window=16)
    states = states_for(model, 30)
    ctx = None
    for lo, hi in ((0, 7), (7, 8), (8, 19), (19, 30)):
        ctx = model.extend_context(ctx, states[lo:hi], lo)
    full = model.encode_context(states)
    assert len(ctx) == len(full) == 16
    assert torch.equal(ctx.positions, torch.arange(14, 30))
    for a, b in zip(ctx.keys + ctx.values, full.keys + full.values):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_batched_drafting_equals_one_at_a_time(target):
    model = make_drafter(target)
    ctxs = [model.encode_context(states_for(model, n, seed=n)) for n in (3, 11, 24)]
    anchors = torch.tensor([5, 6, 7])
    noise = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    batched = model.draft(ctxs, anchors, noise, passes=2)
    for row in range(3):
        single = model.draft([ctxs[row]], anchors[row:row + 1], noise[row:row + 1], passes=2)
        for b, s in zip(batched, single):
            assert torch.equal(b[row], s[0])


def test_jacobi_fixed_point(target):
    model = make_drafter(target)
    ctx = model.encode_context(states_for(model, 9))
    n = 8
    noise = torch.randint(0, VOCAB, (1, n - 1), generator=torch.Generator().manual_seed(6))
    outs = model.draft([ctx], torch.tensor([3]), noise, passes=n + 2, early_exit=False)
    # causal in the block: position i is final after i+1 passes, so n passes reach the fixed point
    fixed = next(r for r in range(1, len(outs)) if torch.equal(outs[r], outs[r - 1]))
    assert fixed <= n
    assert all(torch.equal(o, outs[fixed]) for o in outs[fixed:])
    fast = model.draft([ctx], torch.tensor([3]), noise, passes=n + 2, early_exit=True)
    assert all(torch.equal(a, b) for a, b in zip(outs, fast))


def test_checkpoint_roundtrip(target, tmp_path):
    model = make_drafter(target, subset=torch.arange(0, VOCAB, 2))
    with torch.no_grad():  # fp16 storage: compare against the fp16-rounded weights
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save(tmp_path / "ckpt")
    assert is_checkpoint(tmp_path / "ckpt")
    loaded = DraftModel.load(tmp_path / "ckpt", SharedWeights.from_target(target))
    assert loaded.config == model.config
    assert torch.equal(loaded.vocab_subset, model.vocab_subset)
    states = states_for(model, 13)
    tokens = torch.randint(0, VOCAB, (8,))
    assert torch.equal(one_block(loaded, states, tokens), one_block(model, states, tokens))
    noise = torch.randint(0, VOCAB, (1, 7))
    a = model.draft([model.encode_context(states)], torch.tensor([1]), noise, passes=2)
    b = loaded.draft([loaded.encode_context(states)], torch.tensor([1]), noise, passes=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_proposer_absorbs_rounds_incrementally(target):
    model = make_drafter(target)
    proposer = JetSpecProposer(model, passes=1)
    assert proposer.layout.layers == tuple(model.config.target_layers) and proposer.columns is None  # all, in order
    states = states_for(model, 12)
    ctx = DraftContext(req_id="r", tokens=list(range(1, 9)), seed=7, hidden=[states[:7]])  # 8 tokens, anchor last
    first = proposer.propose(ctx, 5)
    assert len(first) == 5
    ctx.last_block = first
    ctx.absorb(2, 40, states[7:10])  # previous anchor + 2 accepted drafts
    proposer.propose(ctx, 7)
    assert proposer.state(ctx).positions == 10 == len(ctx.tokens) - 1
    fresh = DraftContext(req_id="s", tokens=list(ctx.tokens), seed=7, hidden=[states[:10]])
    assert len(proposer.propose(fresh, 7)) == 7  # whole-history encoding works too
    assert proposer.propose(ctx, 0) == Draft()
    assert set(ctx.states) == set(fresh.states) == {"draft_model"}  # each request's state in its own context
    assert proposer.state(ctx) is not proposer.state(fresh)


def test_commit_takes_the_rounds_states_and_the_next_draft_absorbs_them(target):
    """`commit` takes a round's states out of the context without running the draft model; the next draft
    absorbs them. States no commit took (it failed, or was not called) the next draft takes from the
    context; states the draft model failed on stay pending, in order, for the next try."""
    model = make_drafter(target)
    proposer = JetSpecProposer(model, passes=1)
    states = states_for(model, 14)
    ctx = DraftContext(req_id="r", tokens=list(range(1, 9)), seed=7, hidden=[states[:7]])
    proposer.add_request(ctx)
    state = proposer.state(ctx)
    ctx.last_block = proposer.propose(ctx, 5)
    ctx.absorb(2, 40, states[7:10])
    proposer.commit(ctx)
    assert ctx.hidden == [] and state.positions == 7 and len(state.pending) == 1  # taken, not yet absorbed
    ctx.last_block = proposer.propose(ctx, 5)
    assert state.positions == 10 == len(ctx.tokens) - 1 and state.pending == []
    ctx.absorb(1, 41, states[10:12])  # no commit: the next draft takes them from the context
    real, calls = model.extend_context, []

    def fails_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("draft model failed")
        return real(*args)

    model.extend_context = fails_once
    with pytest.raises(RuntimeError):
        proposer.propose(ctx, 3)
    assert [len(chunk) for chunk in state.pending] == [2] and state.positions == 10  # kept for the next try
    ctx.last_block = Draft()
    ctx.absorb(0, 42, states[12:13])
    proposer.commit(ctx)
    proposer.propose(ctx, 3)
    assert state.positions == 13 == len(ctx.tokens) - 1 and state.pending == []
    torch.testing.assert_close(calls[-1][1], states[10:13])  # both chunks, in order, in one pass


def test_a_failing_commit_costs_nothing_but_its_log(target):
    """The worker commits every outcome; a commit that raises leaves the states to the next draft, and the
    output stays plain greedy."""

    class FailingCommits(JetSpecProposer):
        commits = 0

        def commit(self, ctx):
            self.commits += 1
            if self.commits % 2:
                raise RuntimeError("commit failed")
            super().commit(ctx)

    proposer = FailingCommits(make_drafter(target), passes=1)
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=6), proposer=proposer)
    try:
        for prompt in PROMPTS:
            got = engine.generate(prompt, 20, mode="sync", temperature=0.0)
            assert got["tokens"] == plain_greedy(target, prompt, 20, eos=target.config.eos_token_id)
    finally:
        engine.close()
    assert proposer.commits >= len(PROMPTS)


def test_resolve_drafter_path(tmp_path, target, monkeypatch):
    monkeypatch.setenv("FORESIGHT_CHECKPOINTS", str(tmp_path / "none"))
    assert resolve_drafter_path(EngineConfig(drafter="auto")) is None
    assert resolve_drafter_path(EngineConfig(drafter="ngram")) is None
    with pytest.raises(ConfigError):
        resolve_drafter_path(EngineConfig(drafter=str(tmp_path)))
    make_drafter(target).save(tmp_path / "ckpts" / "smollm2-135m-instruct")
    monkeypatch.setenv("FORESIGHT_CHECKPOINTS", str(tmp_path / "ckpts"))
    assert resolve_drafter_path(EngineConfig(drafter="auto")) == tmp_path / "ckpts" / "smollm2-135m-instruct"
    assert resolve_drafter_path(EngineConfig(drafter="auto", target=str(tmp_path))) is None  # not the default target


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 13, 40], [3, 17, 60, 61, 62]]


def test_sync_greedy_with_random_drafter_equals_plain_greedy(tmp_path):
    path = save_tiny_model("llama", tmp_path)
    model = tiny_model("llama")
    make_drafter(model).save(tmp_path / "drafter")
    cfg = EngineConfig(drafter=str(tmp_path / "drafter"), target=str(path), block_size=6, dtype="float32",
                       draft_passes=2)
    engine = InProcessEngine(model, cfg)
    try:
        assert engine.drafter.proposer.name == "jetspec" and engine.drafter.proposer.passes == 2
        for prompt in PROMPTS:
            got = engine.generate(prompt, 30, mode="sync", temperature=0.0)
            assert got["error"] is None
            assert got["tokens"] == plain_greedy(model, prompt, 30, eos=model.config.eos_token_id)
            assert sum(r.drafted for r in got["rounds"]) > 0
    finally:
        engine.close()
