"""The foresight decoder over Gated DeltaNet hybrids (tiny random Qwen3.5 and Qwen3-Next).

A linear-attention layer's context is its committed recurrent + conv state. Fed the target's TRUE states
at its input index and the target's own committed state (the snapshot the target sends, protocol
`LinearStates`), the decoder must reproduce the target's logits; a snapshot of another position is
stale and must never be used; scoring a block never changes the request's context.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from foresight.models.decoder import ForesightDecoder
from foresight.protocol.messages import HiddenLayout
from foresight.target_worker.runner import TargetRunner
from support.tiny_models import VOCAB, tiny_model

torch.set_num_threads(1)
ATOL = 1e-4  # float32 CPU


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def target(request):
    model = tiny_model(request.param)
    ids = torch.randint(0, VOCAB - 1, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    return model, ids


def true_run(model, ids, index):
    """Whole-sequence target forward: (states at hidden_states index `index` [T, hidden], logits [T, vocab])."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[index][0], out.logits[0].float()


def snapshots(model, dec, ids, cuts):
    """The target worker's snapshots after prefilling ids[:cuts[0]] and extending to each later cut."""
    runner = TargetRunner(model, HiddenLayout(state_layers=tuple(dec.linear_layers)), logits="model")
    cache, done, snaps = runner.new_cache(), 0, {}
    for cut in cuts:
        runner.forward(cache, ids[done:cut])
        done = snaps_at = cut
        snaps[snaps_at] = runner.linear_states(cache, cut)
    return snaps


@pytest.mark.parametrize("n_layers", [1, 2, 4])
def test_true_states_and_the_targets_state_reproduce_target_logits(target, n_layers):
    model, ids = target
    dec = ForesightDecoder(model, n_layers)
    assert dec.linear_layers == [i for i in range(4 - n_layers, 3)]  # layers 0..2 are linear, 3 full attention
    states, logits = true_run(model, ids, dec.input_index)
    snaps = snapshots(model, dec, ids, [8, 12, 16]) if dec.linear_layers else {8: None, 12: None, 16: None}

    cache = dec.new_cache()
    dec.extend_context(cache, states[:8], 0, snaps[8])  # the prompt, then one round's committed positions
    dec.extend_context(cache, states[8:12], 8, snaps[12])
    assert cache.length == 12 and cache.adopted == (2 if dec.linear_layers else 0)
    block = states[12:16]  # anchor at position 12 + 3 drafts
    got = dec.logits(cache, block, 12)
    torch.testing.assert_close(got, logits[12:16], atol=ATOL, rtol=0)
    assert torch.equal(dec.logits(cache, block), got)  # scoring left the context (and its state) as it was
    dec.extend_context(cache, states[12:16], 12, snaps[16])
    torch.testing.assert_close(dec.logits(cache, states[16:20]), logits[16:20], atol=ATOL, rtol=0)

    # Without snapshots the decoder advances the state itself over the same true states: the same logits.
    own = dec.new_cache()
    dec.extend_context(own, states[:12], 0)
    torch.testing.assert_close(dec.logits(own, block), got, atol=ATOL, rtol=0)


def test_a_snapshot_is_used_only_at_its_own_position(target):
    """A stale snapshot (another position) is ignored; one at the context's position is what the linear
    layers continue from: a corrupted one there changes the logits, so the check above could fail."""
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, logits = true_run(model, ids, dec.input_index)
    snaps = snapshots(model, dec, ids, [8, 12])
    cache = dec.new_cache()
    dec.extend_context(cache, states[:12], 0, snaps[8])  # stale: covers 8 positions, the context 12
    assert (cache.adopted, cache.stale) == (0, 1)
    torch.testing.assert_close(dec.logits(cache, states[12:16]), logits[12:16], atol=ATOL, rtol=0)

    wrong = dataclasses.replace(snaps[12], recurrent=snaps[12].recurrent + 1.0)
    assert dec.adopt(cache, wrong) and cache.adopted == 1
    assert (dec.logits(cache, states[12:16]) - logits[12:16]).abs().max() > 1e-2
    assert dec.adopt(cache, snaps[12])
    torch.testing.assert_close(dec.logits(cache, states[12:16]), logits[12:16], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="layers"):
        dec.adopt(cache, dataclasses.replace(snaps[12], layers=[0], conv=snaps[12].conv[:1],
                                             recurrent=snaps[12].recurrent[:1]))


def test_one_pass_extension_ends_at_the_snapshot(target):
    """New context states and a block in one pass: with the target's snapshot the pass runs once and the
    context ends at the snapshot; without one it takes two passes. Both equal extend-then-score."""
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, logits = true_run(model, ids, dec.input_index)
    snaps = snapshots(model, dec, ids, [8, 11])
    two, one, plain = dec.new_cache(), dec.new_cache(), dec.new_cache()
    for cache in (two, one, plain):
        dec.extend_context(cache, states[:8], 0, snaps[8])
    dec.extend_context(two, states[8:11], 8, snaps[11])
    want = dec.logits_and_hidden(two, states[11:15], 11)
    got = dec.logits_and_hidden(one, states[11:15], 11, context_states=states[8:11], linear_states=snaps[11])
    fallback = dec.logits_and_hidden(plain, states[11:15], 11, context_states=states[8:11])
    for w, g, f in zip(want, got, fallback):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        torch.testing.assert_close(f, w, atol=ATOL, rtol=0)
    assert one.length == two.length == plain.length == 11
    assert (one.adopted, plain.adopted) == (2, 1)
    torch.testing.assert_close(dec.logits(one, states[11:16]), logits[11:16], atol=ATOL, rtol=0)
    torch.testing.assert_close(dec.logits(plain, states[11:16]), logits[11:16], atol=ATOL, rtol=0)


def test_rows_start_from_the_same_state_and_the_context_only_grows(target):
    model, ids = target
    dec = ForesightDecoder(model, 2)
    states, _ = true_run(model, ids, dec.input_index)
    cache = dec.new_cache()
    dec.extend_context(cache, states[:10], 0)
    rows = torch.stack([states[10:14], states[14:18], states[5:9]])  # [3, 4, hidden]
    batched = dec.logits(cache, rows)
    for b in range(3):
        torch.testing.assert_close(batched[b], dec.logits(cache, rows[b]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="rolled back"):
        dec.extend_context(cache, states[6:10], 6)
    with pytest.raises(ValueError, match="context's end"):
        dec.logits(cache, rows[0], 6)
