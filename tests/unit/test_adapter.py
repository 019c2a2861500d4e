"""The hidden-to-hidden adapter on tiny random targets: shapes, causality inside the block, the context cache
(read-only in predict, incremental == all at once, rollback), what the initialisation makes exact, save/load,
and training (the loss goes down; resume == uninterrupted; a time budget cuts the steps); then the same on
hybrid targets (Qwen3.5, Qwen3-Next: Gated DeltaNet layers, whose context is a committed recurrent state, and
gated attention)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from foresight.models.adapter import Adapter, default_adapter_indices, is_adapter_checkpoint
from foresight.models.adapter_layers import LinearAdapterLayer
from foresight.training.dataset import LabelledData
from foresight.training.labelling import DataDir, LabelSettings, Labeller, label_stream
from foresight.training.train_adapter import (AdapterTrainSettings, adapter_loss, columns, estimate_scales,
                                              sample_adapter_blocks, train_adapter, training_loss)
from support.tiny_models import VOCAB, tiny_config, tiny_model

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


def trained_adapter(target) -> Adapter:
    """An adapter whose weights moved off the target's ("trained") and are fp16-representable."""
    ad = Adapter.from_target(target, INDICES, layers_per_stage=2)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.01 * torch.randn_like(p)).copy_(p.half().float())
    return ad


def test_save_load_round_trip(target, seq, tmp_path):
    ad = trained_adapter(target)
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


def fit_one_batch(target, data: LabelledData, steps: int = 15) -> tuple[list[float], dict]:
    """AdamW steps of a fresh adapter on one sampled batch -> the losses and the last step's stats."""
    cols = columns(data, INDICES, H)
    scales = torch.tensor(estimate_scales(data, cols, 2, seed=0))
    torch.manual_seed(0)
    ad = Adapter.from_target(target, INDICES).train()
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(0), cols, 2, 4, 6)
    opt = torch.optim.AdamW(ad.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, stats = adapter_loss(ad, batch, scales)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, stats


def test_training_steps_lower_the_loss(data_dir, target):
    losses, stats = fit_one_batch(target, LabelledData(data_dir))
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


def test_time_budget_cuts_the_steps(data_dir, target, tmp_path, monkeypatch):
    """A budget cuts the run to the steps that fit at the measured rate (a fake clock: every step takes 1 s)."""
    import foresight.training.train_adapter as ta

    clock = {"t": 0.0}

    def one_second_steps(*args, **kw):
        clock["t"] += 1.0
        return training_loss(*args, **kw)

    monkeypatch.setattr(ta, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(ta, "training_loss", one_second_steps)
    s = AdapterTrainSettings(steps=400, batch_seqs=1, anchors=1, block_size=6, ckpt_every=10_000, warmup=1,
                             time_budget_s=40.0)
    report = train_adapter(target, LabelledData(data_dir), tmp_path, s)
    # the first step and BUDGET_PROBE = 30 timed ones took 31 s: 9 more fit the 40 s budget
    assert report["steps_done"] == 40 and clock["t"] == 40.0
    assert (report["settings"]["steps"], report["settings"]["time_budget_s"]) == (40, 40.0)  # the steps as run
    assert Adapter.load(tmp_path, target).config.extra["train"]["steps"] == 40


def test_cli_passes_the_time_budget(data_dir, target, tmp_path, monkeypatch):
    import foresight.models.loading as loading
    import foresight.training.train_adapter as ta
    from foresight.training.__main__ import main

    seen = []
    monkeypatch.setattr(loading, "resolve_target", lambda path: path)
    monkeypatch.setattr(loading, "load_target", lambda path, dtype, device: target)
    monkeypatch.setattr(ta, "train_adapter", lambda tgt, data, out, s, resume=False: seen.append(s) or
                        {"steps_done": 0, "last50_mean": {}})
    args = ["train", "adapter", "--data-dir", str(data_dir), "--out", str(tmp_path)]
    assert main(args + ["--time-budget", "90"]) == 0 and main(args) == 0
    assert [s.time_budget_s for s in seen] == [90.0, 0.0]


def test_deepened_adapter_predicts_as_before(target, seq):
    ad = trained_adapter(target)  # stages [[0, 1], [2, 3]]
    deep = ad.deepened(target, 1)
    assert deep.config.stage_layers == [[0, 1], [1, 2, 3]] and ad.config.stage_layers == [[0, 1], [2, 3]]
    new = deep.stages[-1][0]
    assert not new.o_proj.weight.any() and not new.mlp.down_proj.weight.any() and new.q_proj.weight.any()
    states = true_states(target, seq[:, :20], INDICES)
    a = ad.predict(ad.extend_context(ad.new_context(), states, 0), seq[:, 20:30], 20)
    b = deep.predict(deep.extend_context(deep.new_context(), states, 0), seq[:, 20:30], 20)
    assert torch.allclose(a, b, atol=1e-5)  # the added layer passes its input through
    with pytest.raises(ValueError):
        ad.deepened(target, 3)  # no target layer below layer 0 to copy


def test_warm_start_deepens_and_trains_the_top_stage_only(data_dir, target, tmp_path):
    data = LabelledData(data_dir)
    start = trained_adapter(target)
    start.config.extra = {"train": {"steps": 7}}
    start.save(tmp_path / "start")
    s = dict(batch_seqs=2, anchors=2, block_size=6, ckpt_every=10, lr=1e-3, warmup=1, steps=3)
    with pytest.raises(ValueError, match="init"):
        train_adapter(target, data, tmp_path / "x", AdapterTrainSettings(deepen_top=1, **s))
    report = train_adapter(target, data, tmp_path / "deep", AdapterTrainSettings(
        init=str(tmp_path / "start"), deepen_top=1, train_top_only=True, decoder_layers=2, **s))
    deep = Adapter.load(tmp_path / "deep", target)
    assert deep.config.stage_layers == [[0, 1], [1, 2, 3]] and deep.config.decoder_layers == 2
    assert deep.config.extra["init"] == {"train": {"steps": 7}}  # the warm start's recipe is kept
    start = Adapter.load(tmp_path / "start", target)
    assert all(torch.equal(x, y) for x, y in zip(start.stages[0].state_dict().values(),
                                                  deep.stages[0].state_dict().values()))  # frozen
    assert deep.stages[-1][0].o_proj.weight.any()  # the added layer learned
    # the first step's loss is the warm start's own: the added layer began as the identity
    cols = columns(data, INDICES, H)
    gen = torch.Generator().manual_seed(0)
    batch = sample_adapter_blocks(data, gen, cols, 2, 2, 6, 4)
    loss, _ = adapter_loss(start.float(), batch, torch.tensor(report["loss_scales"]))
    assert report["history"][0]["loss"] == pytest.approx(loss.item(), rel=1e-4)


# ---------------------------------------------------------------------------------------------- hybrid targets

HYBRIDS = ["qwen3_5", "qwen3_next"]


def make_hybrid(arch: str, seed: int = 0):
    """A tiny Qwen3.5 / Qwen3-Next with 6 layers: Gated DeltaNet at 0-2 and 4-5, gated full attention at 3 (so
    index 4 is an attention layer's output below the final norm). A slow decay, as in support.tiny_models, so
    the recurrent state carries over and a wrong context state shows."""
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = 6
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-3.0)
    return model


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    return make_hybrid(request.param)


def test_hybrid_from_target_and_shapes(hybrid, seq):
    small = tiny_model(hybrid.config.model_type.removesuffix("_text"))  # the 4-layer tiny target, default indices
    ad = Adapter.from_target(small)
    assert ad.target_indices == [1, 2] and all(isinstance(layer, LinearAdapterLayer) for s in ad.stages for layer in s)
    ad = Adapter.from_target(hybrid, INDICES)
    assert ad.config.stage_layers == [[1], [3]] and ad.has_linear
    assert isinstance(ad.stages[0][0], LinearAdapterLayer) and ad.stages[1][0].gated
    actx = ad.extend_context(ad.new_context(), true_states(hybrid, seq[:, :20], INDICES), 0)
    assert len(actx) == 20 and actx.keys[0][0] is None and actx.states[1][0] is None
    conv, rec = actx.states[0][0]
    assert conv.shape == (ad.stages[0][0].mixer.conv_dim, 4) and rec.shape == (2, 8, 8) and rec.dtype == torch.float32
    out = ad.predict(actx, seq[:, 20:28].expand(3, -1))
    assert out.shape == (3, 8, 2 * H)
    torch.testing.assert_close(out[0], out[2], rtol=1e-6, atol=1e-8)  # rows share the context (MoE: not bitwise)
    assert ad.predict(ad.new_context(), seq[:, :5], 0).shape == (1, 5, 2 * H)  # no context at all
    with pytest.raises(ValueError):
        ad.predict(actx, seq[:, 10:18], 10)  # a recurrent state cannot restart before the end
    with pytest.raises(ValueError):
        ad.extend_context(actx, torch.zeros(2, 2 * H), 18)  # nor roll back


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_initialisation_is_exact_on_true_inputs(arch, seq):
    """As test_initialisation_is_exact_on_true_inputs, on a hybrid: a stage copied from a Gated DeltaNet layer
    (its context: the state its mixer reaches over the true index-(l-1) context states) and one copied from
    the gated full-attention layer reproduce the target's index l; so does the consecutive chain."""
    model = make_hybrid(arch)
    T = 28
    hs = model(seq, output_hidden_states=True).hidden_states
    ad = Adapter.from_target(model, [2, 4])
    for stage, ell in enumerate((2, 4)):  # copies of layer 1 (linear attention) and layer 3 (full attention)
        out = ad.stage_forward(stage, hs[ell - 1][:, T:], hs[ell - 1][0], T)
        torch.testing.assert_close(out, hs[ell][:, T:], rtol=1e-5, atol=1e-6)
    chain = [1, 2, 3, 4, 5]
    ad = Adapter.from_target(model, chain)
    lower = torch.cat([hs[i - 1][0] for i in chain], dim=-1)
    exact = ad.predict(ad.extend_context(ad.new_context(), lower[:T], 0), seq[:, T:], T)
    truth = torch.cat([hs[i][0, T:] for i in chain], dim=-1)
    torch.testing.assert_close(exact[0], truth, rtol=1e-5, atol=1e-6)
    served = ad.predict(ad.extend_context(ad.new_context(), true_states(model, seq[:, :T], chain), 0), seq[:, T:])
    blind = ad.predict(ad.new_context(), seq[:, T:], 0)  # no context: the recurrent state matters
    assert (served[0] - truth).abs().max() > 1e-4 and (blind[0] - truth).abs().max() > 1e-3


def test_hybrid_context_cache(hybrid, seq):
    """Incremental extend_context == all at once; predict leaves the context unchanged; rows are independent."""
    ad = Adapter.from_target(hybrid, [1, 2, 4], layers_per_stage=2)  # stages: [0], [0, 1], [2, 3]
    states = true_states(hybrid, seq[:, :30], [1, 2, 4])
    once = ad.extend_context(ad.new_context(), states, 0)
    inc = ad.new_context()
    for lo, hi in ((0, 7), (7, 8), (8, 30)):
        prev, before = inc, [[None if st is None else tuple(t.clone() for t in st) for st in s] for s in inc.states]
        inc = ad.extend_context(inc, states[lo:hi], lo)
        assert len(prev) == lo and _same_states(prev.states, before)  # a new context; the old one is untouched
    for a, b in zip(_flat(once.states), _flat(inc.states)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for ks_a, ks_b in zip(once.keys + once.values, inc.keys + inc.values):
        for a, b in zip(ks_a, ks_b):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    block = seq[:, 30:36]
    first = ad.predict(once, block)
    torch.testing.assert_close(ad.predict(inc, block), first, rtol=1e-5, atol=1e-7)
    kept = [[None if st is None else tuple(t.clone() for t in st) for st in s] for s in once.states]
    rows = torch.stack([seq[0, 30:36], seq[0, 2:8], seq[0, 11:17]])
    batched = ad.predict(once, rows)  # a batch of different rows, each continuing the same context
    assert torch.equal(ad.predict(once, block), first) and _same_states(once.states, kept) and len(once) == 30
    for i in range(3):
        torch.testing.assert_close(batched[i], ad.predict(once, rows[i:i + 1])[0], rtol=1e-5, atol=1e-7)


def _flat(states):
    return [t for stage in states for st in stage if st is not None for t in st]


def _same_states(a, b) -> bool:
    return all((x is None) == (y is None) and (x is None or all(torch.equal(s, t) for s, t in zip(x, y)))
               for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_hybrid_save_load_round_trip(hybrid, seq, tmp_path):
    ad = trained_adapter(hybrid)
    ad.save(tmp_path / "ad")
    back = Adapter.load(tmp_path / "ad", hybrid)
    assert isinstance(back.stages[0][1], LinearAdapterLayer) and back.config.stage_layers == [[0, 1], [2, 3]]
    states = true_states(hybrid, seq[:, :20], INDICES)
    a = ad.predict(ad.extend_context(ad.new_context(), states, 0), seq[:, 20:30])
    b = back.predict(back.extend_context(back.new_context(), states, 0), seq[:, 20:30])
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def hybrid_data(tmp_path_factory, hybrid):
    """Labelled data of the hybrid target (as data_dir): indices 2 (after a linear layer), 4 (after attention)."""
    path = tmp_path_factory.mktemp("adapter-hybrid-data")
    layers = INDICES + [6]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 70, (10,), generator=gen).tolist()
    items = [torch.randint(3, 40, (12,), generator=gen).repeat(6)[:n].tolist() for n in lengths]  # repetitive
    settings = LabelSettings(layers=layers, topk=4, max_len=80, min_len=20, shard_tokens=300, batch_size=1)
    label_stream(Labeller(hybrid, settings), DataDir(path, {"target_name": "tiny", "layers": layers, "topk": 4}),
                 "text", items, lambda b, _: b, max_tokens=None)
    return path


def test_hybrid_forward_blocks_equals_predict(hybrid_data, hybrid):
    """Training's many blocks per row (linear layers: the context run in segments up to each anchor) predict
    what inference predicts for each block alone; gradients reach every weight; other masks are refused."""
    data = LabelledData(hybrid_data)
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(3), columns(data, INDICES, H), 2, 4, 6)
    ad = Adapter.from_target(hybrid, INDICES, layers_per_stage=2)
    pred = ad.forward_blocks(batch.ctx_states, batch.tokens, batch.positions, batch.mask)  # [2, 24, 2H]
    for row in range(2):
        for a in range(4):
            sl = slice(a * 6, (a + 1) * 6)
            n = int(batch.positions[row, a * 6])
            actx = ad.extend_context(ad.new_context(), batch.ctx_states[row, :n], 0)
            torch.testing.assert_close(pred[row, sl], ad.predict(actx, batch.tokens[row:row + 1, sl])[0],
                                       rtol=1e-5, atol=1e-6)
    pred.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for name, p in ad.named_parameters()
               if "experts" not in name)  # an unrouted expert gets no gradient
    # a linear-only adapter sees the context through the start states alone: the gradient flows through them
    ctx = batch.ctx_states[..., :H].float().requires_grad_()
    Adapter.from_target(hybrid, [2]).forward_blocks(ctx, batch.tokens, batch.positions, batch.mask).sum().backward()
    n = int(batch.positions[0, ::6].max())
    assert ctx.grad[0, :n].abs().sum(-1).min() > 0 and not ctx.grad[0, n:].any()
    bad = batch.mask.clone()
    bad[0, 0, batch.ctx_states.shape[1] + 1] = True  # not causal: attention would follow it, a recurrence cannot
    with pytest.raises(ValueError):
        ad.forward_blocks(batch.ctx_states, batch.tokens, batch.positions, bad)


def test_hybrid_training(hybrid_data, hybrid, tmp_path):
    """On a hybrid target: steps on one batch lower its loss; a run lowers the loss of unseen blocks, its
    checkpoint loads, and resume == uninterrupted."""
    data = LabelledData(hybrid_data)
    losses, _ = fit_one_batch(hybrid, data)
    assert losses[-1] < 0.7 * losses[0], losses
    s = dict(batch_seqs=2, anchors=3, block_size=6, ckpt_every=16, lr=1e-3, warmup=1, decay_frac=0.0)
    quiet = dict(log=lambda *_: None)
    full = train_adapter(hybrid, data, tmp_path / "a", AdapterTrainSettings(steps=32, **s), **quiet)
    train_adapter(hybrid, data, tmp_path / "b", AdapterTrainSettings(steps=16, **s), **quiet)
    resumed = train_adapter(hybrid, data, tmp_path / "b", AdapterTrainSettings(steps=32, **s), resume=True, **quiet)
    run = [h["loss"] for h in full["history"]]
    assert run == pytest.approx([h["loss"] for h in resumed["history"]], rel=1e-5)
    assert sum(run[-8:]) < 0.8 * sum(run[:8]), run
    a, b = Adapter.load(tmp_path / "a", hybrid), Adapter.load(tmp_path / "b", hybrid)
    assert isinstance(a.stages[0][0], LinearAdapterLayer) and a.stages[1][0].gated
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    cols = columns(data, INDICES, H)
    scales = torch.tensor(estimate_scales(data, cols, 2, seed=0))
    unseen = sample_adapter_blocks(data, torch.Generator().manual_seed(99), cols, 8, 4, 6)
    with torch.no_grad():
        before = adapter_loss(Adapter.from_target(hybrid, INDICES), unseen, scales)[0]
        after = adapter_loss(a, unseen, scales)[0]
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_deepened_adapter_predicts_as_before(arch, seq):
    """An added Gated DeltaNet layer starts as the identity too (mixer output and MLP down projections
    zeroed); a mixture-of-experts MLP (Qwen3-Next) has no single down projection and is refused."""
    model = make_hybrid(arch)
    ad = Adapter.from_target(model, [2, 4])  # stages [[1], [3]]: the added layer copies layer 2 (linear attention)
    if not hasattr(model.model.layers[2].mlp, "down_proj"):
        with pytest.raises(NotImplementedError, match="dense MLP"):
            ad.deepened(model, 1)
        return
    deep = ad.deepened(model, 1)
    assert isinstance(deep.stages[-1][0], LinearAdapterLayer) and not deep.stages[-1][0].mixer.out_proj.weight.any()
    states = true_states(model, seq[:, :20], [2, 4])
    a = ad.predict(ad.extend_context(ad.new_context(), states, 0), seq[:, 20:30], 20)
    b = deep.predict(deep.extend_context(deep.new_context(), states, 0), seq[:, 20:30], 20)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
