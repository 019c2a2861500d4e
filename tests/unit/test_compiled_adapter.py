"""The foresight adapter's compiled prediction and context extension (models/compiled_adapter.py) against the eager
adapter they replace, on tiny Llama and Qwen3 targets in fp32: contexts extended (a prompt, rounds, a rollback) and
blocks predicted after them, blocks inside the context; predictions it does not take (several rows, a block at
position 0) stay eager and equal; a failing compiler leaves the adapter eager; pipelined greedy decoding with the
compiled adapter equals plain greedy decoding. Compiling costs ~20 s a model here: one build per model."""
from __future__ import annotations

import logging

import pytest
import torch

from foresight.config import EngineConfig
from foresight.models.adapter import Adapter
from foresight.models.compiled_adapter import (CompiledAdapter, compile_adapter_refusal, compiled_adapter_for,
                                               compiled_adapter_info)
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model
from test_compiled_decoder import target  # noqa: F401 -- the fixture: tiny Llama and Qwen3 targets, 40 token ids
from test_foresight import GAMMA, NEW, PROMPTS, make_drafter

torch.set_num_threads(1)
ATOL = 1e-5  # fp32: the graph fuses in another order
INDICES = [1, 2]  # two stages, of 1 and 2 copied layers (target layers 0; 0 and 1)


@pytest.fixture(scope="module")
def adapters(target, tmp_path_factory):
    """An eager adapter and the same adapter with its prediction compiled."""
    model, _ = target
    eager = Adapter.from_target(model, INDICES, bottom_layers=1, layers_per_stage=2)
    fast = Adapter.from_target(model, INDICES, bottom_layers=1, layers_per_stage=2)
    fast.load_state_dict(eager.state_dict())
    compiled = CompiledAdapter(fast, tmp_path_factory.mktemp("compiled"), autotune=False)
    compiled.build()
    fast.compiled = compiled
    return eager, fast


def true_states(model, ids):
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in INDICES], dim=-1)  # [T, n_idx * hidden]


def assert_equal_contexts(got, want):
    assert got.length == want.length
    for got_layers, want_layers in zip(got.keys + got.values, want.keys + want.values):
        for g, w in zip(got_layers, want_layers):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=ATOL)


def test_compiled_predictions_equal_eager_ones_through_extensions_and_rollbacks(target, adapters):
    """Contexts extended by the context graph (a prompt, rounds, a rollback), blocks predicted by the block graph."""
    model, ids = target
    eager, fast = adapters
    states = true_states(model, ids)
    passes, extensions = fast.compiled.passes, fast.compiled.extensions
    context = eager.extend_context(eager.new_context(), states[:9], 0)
    compiled_context = fast.extend_context(fast.new_context(), states[:9], 0)
    for extend_at, new, width in ((9, 3, 5), (12, 1, 1), (10, 6, 3), (16, 14, 9)):  # (10, ...): rolled back to 10
        context = eager.extend_context(context, states[extend_at:extend_at + new], extend_at)
        compiled_context = fast.extend_context(compiled_context, states[extend_at:extend_at + new], extend_at)
        assert_equal_contexts(compiled_context, context)
        tokens = ids[:, extend_at + new:extend_at + new + width]
        torch.testing.assert_close(fast.predict(compiled_context, tokens), eager.predict(context, tokens), atol=ATOL,
                                   rtol=ATOL)
    inside = ids[:, 20:24]  # a block that starts inside the context (a refresh's anchor)
    torch.testing.assert_close(fast.predict(compiled_context, inside, 20), eager.predict(context, inside, 20),
                               atol=ATOL, rtol=ATOL)
    assert fast.compiled.passes - passes == 5 and fast.compiled.eager_passes == 0
    assert fast.compiled.extensions - extensions == 5


def test_predictions_the_graph_does_not_take_stay_eager_and_equal(target, adapters):
    """Several rows over one context or two, and a block at position 0 (no context)."""
    model, ids = target
    eager, fast = adapters
    states = true_states(model, ids)
    short = eager.extend_context(eager.new_context(), states[:12], 0)
    long = eager.extend_context(short, states[12:20], 12)
    passes, skipped = fast.compiled.passes, fast.compiled.eager_passes
    rows = ids[0, 20:28].view(2, 4)
    for actxs, starts in (([long, long], None), ([short, long], None), ([long, long], [0, 0])):
        torch.testing.assert_close(fast.predict_many(actxs, rows, starts), eager.predict_many(actxs, rows, starts),
                                   atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(fast.predict(eager.new_context(), rows[:1]), eager.predict(eager.new_context(),
                                                                                         rows[:1]), atol=ATOL,
                               rtol=ATOL)
    assert fast.compiled.passes == passes and fast.compiled.eager_passes == skipped + 4


def test_a_failing_compiler_leaves_the_adapter_eager(target, tmp_path, monkeypatch, caplog):
    model, _ = target
    adapter = Adapter.from_target(model, INDICES)

    def broken(self, path):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(CompiledAdapter, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="foresight.compiled_step"):
        assert compiled_adapter_for(adapter, "auto", "cpu", tmp_path) is None
    assert adapter.compiled is None and "injected compiler failure" in caplog.text
    assert compiled_adapter_for(adapter, "off", "cpu", tmp_path) is None
    assert compiled_adapter_info(adapter) == {"adapter_pass": False, "adapter_compile_s": 0.0, "adapter_loaded": 0}
    assert compile_adapter_refusal(adapter, "cuda") is not None
    hybrid = tiny_model("qwen3_5")
    linear_index = hybrid.config.get_text_config(decoder=True).layer_types.index("linear_attention") + 1
    assert compile_adapter_refusal(Adapter.from_target(hybrid, [linear_index]), "cpu") is not None


def test_pipelined_greedy_with_the_compiled_adapter_equals_plain_greedy(tmp_path):
    """The foresight drafter of test_foresight.py with a real adapter (copied target layers) in place of its oracle,
    the adapter's prediction compiled: lossless, its predictions through the graph."""
    model = tiny_model("llama", varied=True)
    sequences = [p + plain_greedy(model, p, NEW, eos=model.config.eos_token_id) for p in PROMPTS]
    drafter = make_drafter(model, sequences, passes=1, cache_size=4, temperature=0.0)
    drafter.scorer.adapter = Adapter.from_target(model, drafter.scorer.adapter.target_indices)
    compiled = compiled_adapter_for(drafter.scorer.adapter, "on", "cpu", tmp_path, autotune=False)
    assert compiled is not None and drafter.scorer.adapter.compiled is compiled
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    try:
        for prompt, seq in zip(PROMPTS, sequences):
            got = engine.generate(prompt, NEW, mode="pipelined", temperature=0.0)
            assert got["error"] is None and got["tokens"] == seq[len(prompt):]
    finally:
        engine.close()
    assert compiled.passes > 0
    info = compiled_adapter_info(drafter.scorer.adapter)
    assert info == {"adapter_pass": True, "adapter_compile_s": round(compiled.compile_s, 1), "adapter_loaded": 0}
    assert compiled.extensions > 0
