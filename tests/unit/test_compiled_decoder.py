"""The foresight decoder's compiled pass (models/compiled_decoder.py) against the eager decoder it replaces, on tiny
Llama and Qwen3 targets in fp32: context extensions (a first one into empty buffers, rollbacks), blocks scored with
new context states in the same pass, the states it passes through; passes it does not take (several rows, a block
inside the context) stay eager and equal; a failing compiler leaves the pass eager; pipelined greedy decoding with
the compiled decoder equals plain greedy decoding. Compiling costs ~10 s a model here: one build per model."""
from __future__ import annotations

import logging

import pytest
import torch

from foresight.config import EngineConfig
from foresight.models import compiled_decoder as compiled_module
from foresight.models.compiled_decoder import CompiledDecoder, compiled_decoder_for, compiled_decoder_info
from foresight.models.decoder import ForesightDecoder
from foresight.models.slot_kv import SlotLayer
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB, plain_greedy, tiny_model
from test_foresight import GAMMA, NEW, PROMPTS, make_drafter

torch.set_num_threads(1)
ATOL = 1e-5  # fp32: the graph fuses in another order


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    model = tiny_model(request.param, varied=True)
    ids = torch.randint(0, VOCAB - 1, (1, 40), generator=torch.Generator().manual_seed(3))
    return model, ids


@pytest.fixture(scope="module")
def decoders(target, tmp_path_factory):
    """An eager decoder and a compiled one over the target's top 2 layers, keeping the states between them."""
    model, _ = target
    eager, fast = ForesightDecoder(model, 2), ForesightDecoder(model, 2)
    keep = (model.config.num_hidden_layers - 1,)
    compiled = CompiledDecoder(fast, keep, tmp_path_factory.mktemp("compiled"), autotune=False)
    compiled.build()
    fast.use_compiled(compiled)
    return eager, fast, keep


def true_states(model, ids, index):
    with torch.inference_mode():
        return model(ids, output_hidden_states=[index]).hidden_states[index][0]  # [T, hidden]


def assert_equal_passes(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=ATOL)


def test_compiled_passes_equal_eager_ones_through_extensions_and_rollbacks(target, decoders):
    model, ids = target
    eager, fast, keep = decoders
    states = true_states(model, ids, eager.input_index)
    plain, slots = eager.new_cache(), fast.new_cache()
    assert all(isinstance(slots.kv.layers[i], SlotLayer) for i in fast.attention_layers)
    before = fast.compiled.passes
    for cache, decoder in ((plain, eager), (slots, fast)):
        decoder.extend_context(cache, states[:9], 0)  # a prompt: the first buffers
    for start, new, width in ((9, 3, 5), (12, 1, 4), (10, 6, 3), (16, 0, 6)):  # (10, 6, ...): 3 positions rolled back
        for cache in (plain, slots):
            if start < cache.length:
                (eager if cache is plain else fast).extend_context(cache, states[start:start], start)
        block = states[start + new:start + new + width] + 0.01  # predicted states: near the true ones
        context = states[start:start + new] if new else None
        want = eager.logits_and_hidden(plain, block, start + new, keep, context)
        got = fast.logits_and_hidden(slots, block, start + new, keep, context)
        assert_equal_passes(got, want)
        assert slots.length == plain.length == start + new
    full = states[:30]
    for cache, decoder in ((plain, eager), (slots, fast)):
        decoder.extend_context(cache, full[cache.length:], cache.length)
    assert_equal_passes(fast.logits_and_hidden(slots, states[30:34], None, keep),
                        eager.logits_and_hidden(plain, states[30:34], None, keep))
    assert fast.compiled.passes - before == 7 and fast.compiled.eager_passes == 0


def test_passes_the_graph_does_not_take_stay_eager_and_equal(target, decoders):
    """Several rows over one context, a block starting inside the context, another `keep`."""
    model, ids = target
    eager, fast, keep = decoders
    states = true_states(model, ids, eager.input_index)
    plain, slots = eager.new_cache(), fast.new_cache()
    eager.extend_context(plain, states[:20], 0)
    fast.extend_context(slots, states[:20], 0)
    passes, skipped = fast.compiled.passes, fast.compiled.eager_passes
    blocks = torch.stack([states[20:24], states[20:24] + 0.02])  # [2, 4, hidden]
    assert_equal_passes(fast.logits_and_hidden(slots, blocks, None, keep),
                        eager.logits_and_hidden(plain, blocks, None, keep))
    assert_equal_passes(fast.logits_and_hidden(slots, states[12:16], 12, keep),
                        eager.logits_and_hidden(plain, states[12:16], 12, keep))
    assert_equal_passes(fast.logits_and_hidden(slots, states[20:24]), eager.logits_and_hidden(plain, states[20:24]))
    assert fast.compiled.passes == passes and fast.compiled.eager_passes == skipped + 1  # () is another keep
    assert_equal_passes(fast.logits_and_hidden(slots, states[20:24], None, keep),  # and the cache goes on compiled
                        eager.logits_and_hidden(plain, states[20:24], None, keep))
    assert fast.compiled.passes == passes + 1 and slots.length == 20


def test_a_failing_compiler_leaves_the_pass_eager(target, tmp_path, monkeypatch, caplog):
    model, _ = target
    decoder = ForesightDecoder(model, 2)

    def broken(self, path):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(CompiledDecoder, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="foresight.compiled_decoder"):
        assert compiled_decoder_for(decoder, (), "auto", "cpu", tmp_path) is None
    assert decoder.compiled is None and "injected compiler failure" in caplog.text
    assert not any(isinstance(layer, SlotLayer) for layer in decoder.new_cache().kv.layers)
    assert compiled_decoder_for(decoder, (), "off", "cpu", tmp_path) is None
    assert compiled_module.compile_decoder_refusal(decoder, "cuda") is not None
    assert compiled_module.compile_decoder_refusal(ForesightDecoder(tiny_model("qwen3_5"), 2), "cpu") is not None


def test_pipelined_greedy_with_the_compiled_decoder_equals_plain_greedy(tmp_path):
    """The foresight drafter of test_foresight.py (oracle adapter, a real draft model and decoder) with its decoder
    compiled: lossless, outcomes pre-drafted, the decoder's passes through the graph."""
    model = tiny_model("llama")
    sequences = [p + plain_greedy(model, p, NEW, eos=model.config.eos_token_id) for p in PROMPTS]
    drafter = make_drafter(model, sequences, passes=1, cache_size=4, temperature=0.0)
    compiled = compiled_decoder_for(drafter.scorer.decoder, drafter.scorer.decoder_keep, "on", "cpu", tmp_path, autotune=False)
    assert compiled is not None and drafter.scorer.decoder.compiled is compiled
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=GAMMA + 1), proposer=drafter,
                             foresight_to_completion=True)
    hits = 0
    try:
        for prompt, seq in zip(PROMPTS, sequences):
            got = engine.generate(prompt, NEW, mode="pipelined", temperature=0.0)
            assert got["error"] is None and got["tokens"] == seq[len(prompt):]
            hits += sum(bool(r.cache_hit) for r in got["rounds"])
    finally:
        engine.close()
    assert hits > 0 and compiled.passes > 0
    info = compiled_decoder_info(drafter.scorer.decoder)
    assert info == {"decoder_pass": True, "decoder_compile_s": round(compiled.compile_s, 1), "decoder_loaded": 0}
    assert compiled_decoder_info(None)["decoder_pass"] is False
