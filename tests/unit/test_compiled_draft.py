"""The draft model's compiled block pass (models/compiled_draft.py) on a tiny random draft model, fp32: the same
drafts as the eager pass for every batch shape the drafter forms (one graph, symbolic rows, positions and context
columns), eager where the graph does not reach, loaded from the cache at a second start, eager after a failed
compile, and through the sync round loop greedy output equal to plain greedy decoding."""
from __future__ import annotations

import logging

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.models.compiled_draft import MAX_TOKENS, CompiledDraft, compiled_draft_for, compiled_draft_info
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB, plain_greedy, tiny_model
from test_draft_model import make_drafter, states_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def compiled(target, tmp_path_factory):
    """A tiny draft model (vocabulary subset, context window 24) with its pass compiled into a fresh cache."""
    model = make_drafter(target, subset=torch.arange(10, 70))
    graph = CompiledDraft(model, tmp_path_factory.mktemp("compiled"))
    graph.build()
    return model, graph


def contexts(model, lengths):
    return [model.encode_context(states_for(model, n, seed=i)) for i, n in enumerate(lengths)]


def both(model, graph, fn, name="pass"):
    """fn() eager, then through the graphs (counting the calls of graph `name`) -> (eager result, compiled result,
    calls)."""
    model.compiled = None
    eager = fn()
    calls = []
    original = graph.graphs[name]
    graph.graphs[name] = lambda *args: calls.append(1) or original(*args)
    model.compiled = graph
    try:
        return eager, fn(), len(calls)
    finally:
        graph.graphs[name], model.compiled = original, None


@pytest.mark.parametrize("lengths,width", [([12], 1), ([12], 2), ([5], 8), ([12, 5, 30], 8), ([3, 24], 3)])
def test_compiled_drafts_equal_eager_for_every_batch_shape(compiled, lengths, width):
    """Rows of different context lengths (left-padded; 30 positions keep the window's 24), 1 to 8 positions, two
    Jacobi passes: the same drafts, confidence within float rounding, every pass through the graph."""
    model, graph = compiled
    ctxs = contexts(model, lengths)
    anchors = torch.arange(3, 3 + len(lengths))
    noise = torch.randint(0, VOCAB, (len(lengths), width - 1), generator=torch.Generator().manual_seed(width))
    (eager_ids, eager_probs), (ids, probs), calls = both(
        model, graph, lambda: model.draft_with_confidence(ctxs, anchors, noise, passes=2))
    assert calls >= 1
    for a, b in zip(eager_ids, ids):
        assert torch.equal(a, b)
    for a, b in zip(eager_probs, probs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(ids) == 3 and ids[0].shape == (len(lengths), width)


def test_fixed_prefixes_through_the_graph(compiled):
    """`draft_after_prefix` (foresight's pre-drafted outcomes): the fixed inputs stay, the drafts equal eager's."""
    model, graph = compiled
    ctxs = contexts(model, [9, 14])
    inputs = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    fixed = torch.tensor([1, 3])
    (eager, _), (got, _), calls = both(model, graph, lambda: model.draft_after_prefix(ctxs, inputs, fixed, passes=2))
    assert calls >= 1 and all(torch.equal(a, b) for a, b in zip(eager, got))


@pytest.mark.parametrize("lengths", [[1], [7, 2], [30], [20, 10]])
def test_compiled_context_extension_equals_eager(compiled, lengths):
    """A context built from chunks of new positions (a prompt, then each round's; 30 keep the window's 24): the same
    keys, values and newest state as the eager extension, every chunk through the context graph."""
    model, graph = compiled
    states = states_for(model, sum(lengths), seed=7)

    def build():
        ctx, at = None, 0
        for n in lengths:
            ctx, at = model.extend_context(ctx, states[at:at + n], at), at + n
        return ctx

    eager, got, calls = both(model, graph, build, name="context")
    assert calls == len(lengths) and torch.equal(eager.positions, got.positions)
    for a, b in zip(eager.keys + eager.values + [eager.last], got.keys + got.values + [got.last]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_block_longer_than_the_graph_runs_eager(compiled):
    model, graph = compiled
    ctxs = contexts(model, [10])
    noise = torch.randint(0, VOCAB, (1, MAX_TOKENS), generator=torch.Generator().manual_seed(4))  # MAX_TOKENS + 1
    assert not graph.takes(1, MAX_TOKENS + 1, 10) and graph.takes(1, MAX_TOKENS, 10)
    (eager, _), (got, _), calls = both(model, graph, lambda: model.draft_with_confidence(ctxs, torch.tensor([3]),
                                                                                        noise, passes=0))
    assert calls == 0 and torch.equal(eager[0], got[0])


def test_a_second_build_loads_the_package(compiled):
    model, graph = compiled
    again = CompiledDraft(model, graph.cache_dir)
    again.build()
    assert again.loaded == 2 and again.compile_s == 0.0 and graph.loaded == 0 and graph.compile_s > 0
    assert compiled_draft_info(None) == {"draft_pass": False, "compile_s": 0.0, "loaded": 0}
    model.compiled = again
    try:
        assert compiled_draft_info(model) == {"draft_pass": True, "compile_s": 0.0, "loaded": 2}
    finally:
        model.compiled = None


def test_a_failed_compile_leaves_the_pass_eager(target, tmp_path, monkeypatch, caplog):
    model = make_drafter(target, seed=5)

    def broken(self, name, path):
        raise RuntimeError("inductor: no C++ compiler\nmore detail")

    monkeypatch.setattr(CompiledDraft, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="foresight.compiled_draft"):
        assert not compiled_draft_for(model, "auto", "cpu", tmp_path)
    assert model.compiled is None
    assert "its block pass failed, running eagerly: RuntimeError: inductor: no C++ compiler" in caplog.text
    ctx = contexts(model, [6])
    assert model.draft(ctx, torch.tensor([3]), torch.zeros(1, 3, dtype=torch.long), passes=0)[0].shape == (1, 4)


def test_compile_choices(target, tmp_path):
    model = make_drafter(target, seed=6)
    assert not compiled_draft_for(model, "off", "cpu", tmp_path) and model.compiled is None
    assert not compiled_draft_for(model, "auto", "cuda:0", tmp_path)  # not built for GPUs: eager, no error
    with pytest.raises(ConfigError, match="drafter_compile: the compiled draft pass is built for CPUs only"):
        compiled_draft_for(model, "on", "cuda:0", tmp_path)
    assert not list(tmp_path.iterdir())  # nothing compiled


def test_sync_greedy_through_the_compiled_pass_equals_plain_greedy(target, compiled):
    """The served round loop drafting through the graph: drafts are rejected, and the output is plain greedy
    decoding's token for token (verification's exactness with partial acceptances: test_round_loop.py)."""
    model, graph = compiled
    calls = []
    original = graph.graphs["pass"]
    graph.graphs["pass"] = lambda *args: calls.append(1) or original(*args)
    model.compiled = graph
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=6, verify_length="max"),
                             proposer=JetSpecProposer(model, passes=1))
    rounds = []
    try:
        for prompt in ([5, 6, 7, 8, 9, 5, 6], [3, 17, 60, 61, 62]):
            got = engine.generate(prompt, 24, mode="sync", temperature=0.0)
            assert got["error"] is None
            assert got["tokens"] == plain_greedy(target, prompt, 24, eos=target.config.eos_token_id)
            rounds += got["rounds"]
        assert calls and any(r.accepted < r.drafted for r in rounds)
    finally:
        engine.close()
        graph.graphs["pass"], model.compiled = original, None
