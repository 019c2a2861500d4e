"""The training-free foresight decoder (JetSpec++ section 4.2, appendix B.1) on tiny random targets.

Fed the target's TRUE states at its input index, the decoder must reproduce the target's own logits
(it is then the perfect decoder of Proposition 1), and scoring a block must never change the
request's context cache.
"""
from __future__ import annotations

import pytest
import torch

from foresight.models.decoder import ForesightDecoder
from support.tiny_models import VOCAB, tiny_config, tiny_model

torch.set_num_threads(1)
ATOL = 1e-4  # float32 CPU; observed differences are ~5e-7


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    model = tiny_model(request.param)
    ids = torch.randint(0, VOCAB - 1, (1, 24), generator=torch.Generator().manual_seed(7))
    return model, ids


def true_run(model, ids, index):
    """Target forward: (states at hidden_states index `index` [T, hidden], logits [T, vocab])."""
    with torch.inference_mode():
        out = model(ids, output_hidden_states=[index])
    return out.hidden_states[index][0], out.logits[0].float()


@pytest.mark.parametrize("n_layers", [1, 2])
def test_true_states_reproduce_target_logits(target, n_layers):
    model, ids = target
    dec = ForesightDecoder(model, n_layers)
    assert dec.input_index == model.config.num_hidden_layers - n_layers
    states, logits = true_run(model, ids, dec.input_index)

    cache = dec.new_cache()
    dec.extend_context(cache, states[:8], 0)  # prompt, then one round's committed positions
    dec.extend_context(cache, states[8:12], 8)
    assert cache.length == 12

    block = states[12:16]  # anchor at position 12 + gamma = 3 drafts
    got = dec.logits(cache, block, 12)
    torch.testing.assert_close(got, logits[12:16], atol=ATOL, rtol=0)
    probs = dec.score(cache, block)  # start_pos defaults to the context length
    torch.testing.assert_close(probs, torch.softmax(logits[12:16], -1), atol=1e-5, rtol=0)

    # Scoring leaves the context untouched: same result twice, same length, and extending after a
    # score continues correctly from the true states.
    assert torch.equal(dec.logits(cache, block, 12), got)
    assert cache.length == 12
    dec.extend_context(cache, states[12:16], 12)
    torch.testing.assert_close(dec.logits(cache, states[16:20]), logits[16:20], atol=ATOL, rtol=0)
    # A block may start inside the context: it then attends to the positions before it only.
    torch.testing.assert_close(dec.logits(cache, block, 12), got, atol=ATOL, rtol=0)
    assert cache.length == 16


def test_keep_returns_the_states_the_decoder_passes_through(target):
    """With true inputs the kept states are the target's own at those indices, the last block its
    final-normed state (hidden_states index L); indices outside the decoder's layers are refused."""
    model, ids = target
    n = model.config.num_hidden_layers
    dec = ForesightDecoder(model, n - 1)  # input index 1, passes through 2..n-1
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    cache = dec.new_cache()
    dec.extend_context(cache, out.hidden_states[1][0, :10], 0)
    logits, states = dec.logits_and_hidden(cache, out.hidden_states[1][0, 10:15], 10, keep=(2,))
    h = model.config.hidden_size
    assert states.shape == (5, 2 * h)
    torch.testing.assert_close(states[:, :h], out.hidden_states[2][0, 10:15], atol=ATOL, rtol=0)
    torch.testing.assert_close(states[:, h:], out.hidden_states[n][0, 10:15], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, out.logits[0, 10:15].float(), atol=ATOL, rtol=0)
    for bad in (1, n):
        with pytest.raises(ValueError, match="passes through"):
            dec.logits_and_hidden(cache, out.hidden_states[1][0, 10:15], 10, keep=(bad,))


def test_context_states_in_the_same_pass_equal_extend_then_score(target):
    """Extending the context inside the scoring pass gives the same logits, states and cache as two calls."""
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, _ = true_run(model, ids, dec.input_index)
    two, one = dec.new_cache(), dec.new_cache()
    for cache in (two, one):
        dec.extend_context(cache, states[:8], 0)
    dec.extend_context(two, states[8:11], 8)
    want = dec.logits_and_hidden(two, states[11:15], 11)
    got = dec.logits_and_hidden(one, states[11:15], 11, context_states=states[8:11])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert one.length == two.length == 11
    torch.testing.assert_close(dec.logits(one, states[11:16]), dec.logits(two, states[11:16]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="right after them"):
        dec.logits_and_hidden(one, states[13:15], 13, context_states=states[11:12])


def test_vocab_subset_scores_only_its_tokens(target):
    """With a vocabulary subset the logits equal the full head's on the subset and are -inf elsewhere."""
    model, ids = target
    subset = torch.arange(0, VOCAB, 3)
    full, sub = ForesightDecoder(model, 1), ForesightDecoder(model, 1, vocab_subset=subset)
    states, _ = true_run(model, ids, full.input_index)
    caches = [full.new_cache(), sub.new_cache()]
    for dec, cache in zip((full, sub), caches):
        dec.extend_context(cache, states[:10], 0)
    want, got = full.logits(caches[0], states[10:14]), sub.logits(caches[1], states[10:14])
    torch.testing.assert_close(got[:, subset], want[:, subset], atol=ATOL, rtol=0)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(got[:, outside]).all()
    assert torch.isclose(sub.score(caches[1], states[10:14]).sum(-1), torch.ones(4)).all()


def test_batched_blocks_match_single(target):
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, logits = true_run(model, ids, dec.input_index)
    cache = dec.new_cache()
    dec.extend_context(cache, states[:12], 0)
    other = torch.randn(4, states.shape[-1], generator=torch.Generator().manual_seed(0))
    both = dec.logits(cache, torch.stack([states[12:16], other]))  # [2, 4, vocab]
    torch.testing.assert_close(both[0], logits[12:16], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], dec.logits(cache, other), atol=ATOL, rtol=0)
    assert cache.length == 12 and cache.kv.layers[dec.first_layer].keys.shape[0] == 1


def test_extend_replaces_tail_and_rejects_gaps(target):
    model, ids = target
    dec = ForesightDecoder(model, 1)
    states, logits = true_run(model, ids, dec.input_index)
    cache = dec.new_cache()
    dec.extend_context(cache, states[:10], 0)
    dec.extend_context(cache, torch.randn(4, states.shape[-1]), 10)  # e.g. predicted, later corrected
    dec.extend_context(cache, states[10:14], 10)  # replaces positions 10..13
    assert cache.length == 14
    torch.testing.assert_close(dec.logits(cache, states[14:18]), logits[14:18], atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        dec.extend_context(cache, states[15:16], 15)  # position 14 would be missing
    with pytest.raises(ValueError):
        dec.logits(cache, states[15:16], 15)


def test_block_at_position_zero_and_empty_context(target):
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, logits = true_run(model, ids, dec.input_index)
    cache = dec.new_cache()
    torch.testing.assert_close(dec.logits(cache, states[:5]), logits[:5], atol=ATOL, rtol=0)
    assert cache.length == 0


def test_eager_attention_mask_sized_from_decoder_layer():
    """Eager builds an explicit mask: sized from layer 0 (empty here) it would be wrong (notes section 3)."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids = torch.randint(0, VOCAB - 1, (1, 16), generator=torch.Generator().manual_seed(3))
    dec = ForesightDecoder(model, 1)
    states, logits = true_run(model, ids, dec.input_index)
    cache = dec.new_cache()
    dec.extend_context(cache, states[:11], 0)
    torch.testing.assert_close(dec.logits(cache, states[11:16]), logits[11:16], atol=ATOL, rtol=0)


def test_shares_target_modules_frozen():
    model = tiny_model("llama")
    dec = ForesightDecoder(model, 2)
    assert dec.layers[0] is model.model.layers[1] and dec.layers[1] is model.model.layers[2]
    assert dec.norm is model.model.norm and dec.lm_head is model.lm_head
    states = torch.randn(3, model.config.hidden_size)
    cache = dec.new_cache()
    dec.extend_context(cache, states, 0)
    assert all(p.grad is None for p in model.parameters())
    assert cache.kv.layers[0].get_seq_length() == 0  # layers below the decoder hold nothing


def test_unsupported_layers_raise():
    from transformers import AutoModelForCausalLM, Qwen3Config

    with pytest.raises(NotImplementedError):  # sliding-window layers (hybrids: test_hybrid_decoder.py)
        ForesightDecoder(tiny_model("gemma3"), 1)
    cfg = tiny_config("qwen3").to_dict()
    cfg.pop("layer_types")
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)  # layers 1, 2 sliding
    windowed = AutoModelForCausalLM.from_config(Qwen3Config(**cfg))
    with pytest.raises(NotImplementedError, match="sliding"):
        ForesightDecoder(windowed, 1)
    with pytest.raises(ValueError):
        ForesightDecoder(tiny_model("llama"), 0)


@pytest.mark.parametrize("varied", [False, True])  # a tied LM head, and one of its own
def test_a_decoder_keeps_only_the_target_parts_it_reads(varied):
    """`keep_decoder_parts`: the layers below the decoder's and an untied embedding are freed (meta device); the
    decoder over what is left scores exactly as over the whole target."""
    from foresight.models.decoder import keep_decoder_parts

    model = tiny_model("llama", varied=varied)
    ids = torch.randint(0, VOCAB - 1, (1, 16), generator=torch.Generator().manual_seed(3))
    states, _ = true_run(model, ids, 1)  # the input of a 2-layer decoder (3 target layers)
    want = ForesightDecoder(model, 2)
    cache = want.new_cache()
    want.extend_context(cache, states[:10], 0)
    expected = want.logits(cache, states[10:14], 10)
    keep_decoder_parts(model, 2, "cpu")
    assert all(p.is_meta for p in model.model.layers[0].parameters())
    assert not any(p.is_meta for layer in model.model.layers[1:] for p in layer.parameters())
    assert model.model.embed_tokens.weight.is_meta == varied
    got = ForesightDecoder(model, 2)
    cache = got.new_cache()
    got.extend_context(cache, states[:10], 0)
    torch.testing.assert_close(got.logits(cache, states[10:14], 10), expected, atol=0, rtol=0)
