"""The hidden-to-hidden adapter on tiny random targets: shapes, causality inside the block, the context cache
(read-only in predict, incremental == all at once, rollback), what the initialisation makes exact, save/load,
and training (the loss goes down; resume == uninterrupted)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from foresight.models.adapter import Adapter, default_adapter_indices, is_adapter_checkpoint
from foresight.training.dataset import LabelledData
from foresight.training.labelling import DataDir, LabelSettings, Labeller, label_stream
from foresight.training.train_adapter import (AdapterTrainSettings, adapter_loss, columns, estimate_scales,
                                              sample_adapter_blocks, train_adapter)
from support.tiny_models import VOCAB, tiny_config

torch.set_num_threads(1)

INDICES = [2, 4]
H = 32


def make_target(arch: str = "llama", layers: int = 6, seed: int = 0):
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = ["full_attention"] * layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def seq():
    return torch.randint(3, VOCAB - 1, (1, 40), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def true_states(model, ids, indices) -> torch.Tensor:
    hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in indices], dim=-1)  # [T, n * H]


def test_default_indices_and_shapes(target, seq):
    assert default_adapter_indices(30) == [3, 15, 27]
    ad = Adapter.from_target(target, [4, 2])
    assert ad.target_indices == [2, 4] and ad.config.stage_layers == [[1], [3]]
    assert Adapter.from_target(target, INDICES, layers_per_stage=2).config.stage_layers == [[0, 1], [2, 3]]
    assert Adapter.from_target(target, INDICES, bottom_layers=2).config.stage_layers == [[0, 1], [3]]
    with pytest.raises(ValueError):
        Adapter.from_target(target, [6])  # index L is the post-final-norm state
    actx = ad.extend_context(ad.new_context(), true_states(target, seq[:, :20], INDICES), 0)
    assert len(actx) == 20
    out = ad.predict(actx, seq[:, 20:28].expand(3, -1), 20)
    assert out.shape == (3, 8, len(INDICES) * H) and out.dtype == torch.float32
    assert torch.equal(out[0], out[2])  # rows share the context
    assert ad.predict(ad.new_context(), seq[:, :5], 0).shape == (1, 5, 2 * H)  # no context at all


def test_causal_inside_the_block(target, seq):
    ad = Adapter.from_target(target, INDICES, layers_per_stage=2)
    actx = ad.extend_context(ad.new_context(), true_states(target, seq[:, :20], INDICES), 0)
    block = seq[:, 20:30].clone()
    changed = block.clone()
    changed[0, 6] = (changed[0, 6] + 1) % VOCAB
    a, b = ad.predict(actx, block, 20), ad.predict(actx, changed, 20)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_predict_leaves_the_context_unchanged(target, seq):
    ad = Adapter.from_target(target, INDICES)
    actx = ad.extend_context(ad.new_context(), true_states(target, seq[:, :20], INDICES), 0)
    keys = [[k.clone() for k in ks] for ks in actx.keys]
    first = ad.predict(actx, seq[:, 20:30], 20)
    ad.predict(actx, seq[:, 10:18].expand(4, -1), 10)  # an earlier start, a batch
    assert torch.equal(ad.predict(actx, seq[:, 20:30], 20), first)
    assert len(actx) == 20 and all(torch.equal(a, b) for ka, kb in zip(keys, actx.keys) for a, b in zip(ka, kb))


def test_extend_incremental_equals_all_at_once(target, seq):
    ad = Adapter.from_target(target, INDICES, layers_per_stage=2)
    states = true_states(target, seq[:, :30], INDICES)
    once = ad.extend_context(ad.new_context(), states, 0)
    inc = ad.new_context()
    for lo, hi in ((0, 7), (7, 8), (8, 30)):
        prev = inc
        inc = ad.extend_context(inc, states[lo:hi], lo)
        assert len(prev) == lo  # extend returns a new context; the old one is untouched
    for ks_a, ks_b in zip(once.keys + once.values, inc.keys + inc.values):
        for a, b in zip(ks_a, ks_b):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ad.predict(once, seq[:, 30:36], 30), ad.predict(inc, seq[:, 30:36], 30),
                               rtol=1e-6, atol=1e-6)
    # rollback: re-extending from an earlier position replaces the tail
    junk = ad.extend_context(once, torch.randn(5, 2 * H), 25)
    fixed = ad.extend_context(junk, states[25:30], 25)
    assert len(junk) == len(fixed) == 30
    torch.testing.assert_close(ad.predict(fixed, seq[:, 30:36]), ad.predict(once, seq[:, 30:36]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        ad.extend_context(once, states[:2], 31)  # a gap


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_initialisation_is_exact_on_true_inputs(arch, seq):
    """A 1-layer stage copied from target layer l-1 IS that layer: given the true index-(l-1) block states and
    context keys/values from the true index-(l-1) context states, it outputs the target's index-l states.
    So with consecutive indices (the bottom stage reads the embeddings = index 0) and the context slots filled
    with the index-(l-1) states, predict reproduces the target. The served context holds index l instead
    (one layer too high for the copied layer): then it is only close, which training corrects."""
    model = make_target(arch)
    T = 28
    hs = model(seq, output_hidden_states=True).hidden_states
    # one stage alone, non-consecutive indices [2, 5]: stage 5 (= copy of layer 4) on true index-4 states
    ad = Adapter.from_target(model, [2, 5])
    out = ad.stage_forward(1, hs[4][:, T:], hs[4][0], T)
    torch.testing.assert_close(out, hs[5][:, T:], rtol=1e-5, atol=1e-6)
    # the whole chain, consecutive indices [1, 2, 3]
    ad = Adapter.from_target(model, [1, 2, 3])
    lower = torch.cat([hs[i][0] for i in (0, 1, 2)], dim=-1)
    exact = ad.predict(ad.extend_context(ad.new_context(), lower[:T], 0), seq[:, T:], T)
    truth = torch.cat([hs[i][0, T:] for i in (1, 2, 3)], dim=-1)
    torch.testing.assert_close(exact[0], truth, rtol=1e-5, atol=1e-6)
    # with the served context (the true states at l itself) it is not exact
    served = ad.predict(ad.extend_context(ad.new_context(), true_states(model, seq[:, :T], [1, 2, 3]), 0),
                        seq[:, T:], T)
    assert (served[0] - truth).abs().max() > 1e-4


def test_save_load_round_trip(target, seq, tmp_path):
    ad = Adapter.from_target(target, INDICES, layers_per_stage=2)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.01 * torch.randn_like(p)).copy_(p.half().float())  # "trained", and fp16-representable
    ad.save(tmp_path / "ad")
    assert is_adapter_checkpoint(tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / "config.json").read_text())
    assert cfg["target_indices"] == INDICES
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "ad" / "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in stored.values())
    assert not any("embed" in k for k in stored)  # the target's embedding is shared, not stored
    back = Adapter.load(tmp_path / "ad", target)
    states = true_states(target, seq[:, :20], INDICES)
    a = ad.predict(ad.extend_context(ad.new_context(), states, 0), seq[:, 20:30], 20)
    b = back.predict(back.extend_context(back.new_context(), states, 0), seq[:, 20:30], 20)
    assert torch.equal(a, b)
    assert back.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("adapter-data")
    layers = INDICES + [6]
    gen = torch.Generator().manual_seed(0)
    # repetitive token sequences, so that the states are predictable from the tokens
    items = [(torch.randint(3, 40, (12,), generator=gen).repeat(6)[:int(torch.randint(40, 70, (1,), generator=gen))]).tolist()
             for _ in range(10)]
    settings = LabelSettings(layers=layers, topk=4, max_len=80, min_len=20, shard_tokens=300, batch_size=2)
    label_stream(Labeller(target, settings), DataDir(path, {"target_name": "tiny", "layers": layers, "topk": 4}),
                 "text", items, lambda b, _: b, max_tokens=None)
    return path


def test_block_sampling(data_dir):
    data = LabelledData(data_dir)
    cols = columns(data, INDICES, H)
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(0), cols, 2, 3, 6, spread=2)
    assert batch.tokens.shape == (2, 18) and batch.targets.shape == (2, 18, 2 * H)
    # row 0, block 1: its targets are the stored states of its positions, its context ends before the anchor
    n = int(batch.positions[0, 6])
    t = batch.ctx_states.shape[1]
    assert batch.mask[0, 6, :t].sum() == n and batch.mask[0, 6, :t][:n].all()
    assert torch.equal(batch.mask[0, 6:12, t:], torch.cat([torch.zeros(6, 6), torch.ones(6, 6).tril(), torch.zeros(6, 6)], 1).bool())
    i0 = None
    for i in range(len(data)):
        if torch.equal(data.read(i, "hidden", n, n + 6)[:, cols], batch.targets[0, 6:12]):
            i0 = i
    assert i0 is not None
    assert torch.equal(batch.copy[0, 6], data.read(i0, "hidden", n - 1, n)[0, cols])
    assert torch.equal(batch.tokens[0, 6:12], data.seq_tokens(i0)[n:n + 6])


def test_training_steps_lower_the_loss(data_dir, target):
    data = LabelledData(data_dir)
    cols = columns(data, INDICES, H)
    scales = torch.tensor(estimate_scales(data, cols, 2, seed=0))
    torch.manual_seed(0)
    ad = Adapter.from_target(target, INDICES).train()
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(0), cols, 2, 4, 6)
    opt = torch.optim.AdamW(ad.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss, stats = adapter_loss(ad, batch, scales)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert len(stats["cos"]) == len(stats["gap_recovered"]) == 2


def test_train_resume_matches_uninterrupted_run(data_dir, target, tmp_path):
    data = LabelledData(data_dir)
    s = dict(batch_seqs=2, anchors=2, block_size=6, ckpt_every=2, lr=1e-3, warmup=1)
    full = train_adapter(target, data, tmp_path / "a", AdapterTrainSettings(steps=4, **s))
    train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=2, **s))
    with pytest.raises(FileExistsError):
        train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=4, **s))
    resumed = train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=4, decoder_layers=2, **s),
                            resume=True)  # the serving depth can be recorded on resume
    assert full["steps_done"] == resumed["steps_done"] == 4
    assert [h["loss"] for h in full["history"]] == pytest.approx([h["loss"] for h in resumed["history"]], rel=1e-5)
    assert full["target_indices"] == INDICES and len(full["loss_scales"]) == 2
    a, b = Adapter.load(tmp_path / "a", target), Adapter.load(tmp_path / "b", target)
    assert (a.config.decoder_layers, b.config.decoder_layers) == (None, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
