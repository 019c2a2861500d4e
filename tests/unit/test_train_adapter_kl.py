"""The adapter's KL loss through the foresight decoder's frozen top layers (training/adapter_kl.py) on tiny
random targets: on the TRUE block states the frozen top reproduces the target's own next-token law (so its
context keys/values, positions and mask are the decoder's), the truncated KL and the agreement, training with
the KL (it trains the adapter only, is logged and resumes), the state loss unchanged without it, the errors
on a missing or unpredicted decoder depth, and the CLI flags."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from foresight.models.adapter import Adapter
from foresight.training.adapter_kl import FrozenTop, kl_loss
from foresight.training.dataset import LabelledData, sample_anchors
from foresight.training.train_adapter import (AdapterTrainSettings, adapter_loss, columns, sample_adapter_blocks,
                                              train_adapter, training_loss)
from support.tiny_models import tiny_model
from test_adapter import H, INDICES, data_dir, make_target, target  # noqa: F401  (fixtures)

BLOCK = 6
RUN = dict(batch_seqs=2, anchors=2, block_size=BLOCK, ckpt_every=2, lr=1e-3, warmup=1)  # a tiny train_adapter run


def sampled(data: LabelledData, seed: int, n_seqs: int = 2, n_anchors: int = 3, spread: int = 2):
    """A batch and the ids of its rows' sequences (sample_anchors draws first, from the same generator)."""
    cols = columns(data, INDICES, H)
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(seed), cols, n_seqs, n_anchors, BLOCK, spread)
    seqs, _, anchors = sample_anchors(data, torch.Generator().manual_seed(seed), n_seqs, n_anchors, BLOCK, spread)
    assert torch.equal(batch.positions[:, ::BLOCK], anchors)
    return batch, seqs.tolist()


@torch.no_grad()
def exact_inputs(model, data: LabelledData, batch, seqs: list[int]):
    """The batch with fp32 context states from `model` itself, the TRUE block states [S, Q, 2H] and the model's
    own log-softmax [S, Q, V] at the block positions (the data's states are fp16: not exact enough)."""
    t = batch.ctx_states.shape[1]
    ctx = torch.zeros(len(seqs), t, 2 * H)
    block = torch.zeros(*batch.tokens.shape, 2 * H)
    ref = torch.zeros(*batch.tokens.shape, model.config.vocab_size)
    for row, i in enumerate(seqs):
        out = model(data.seq_tokens(i)[None], output_hidden_states=True)
        states = torch.cat([out.hidden_states[j][0] for j in INDICES], dim=-1)  # [N, 2H]
        n_ctx = int(batch.positions[row, ::BLOCK].max())
        ctx[row, :n_ctx] = states[:n_ctx]
        pos = batch.positions[row]
        block[row] = states[pos]
        ref[row] = torch.log_softmax(out.logits[0, pos].float(), dim=-1)
    return dataclasses.replace(batch, ctx_states=ctx), block, ref


@pytest.mark.parametrize("arch,n_layers,attention", [("llama", 2, "sdpa"), ("llama", 4, "sdpa"),
                                                     ("llama", 2, "eager"), ("qwen3", 2, "sdpa")])
def test_frozen_top_on_true_states_is_the_target(data_dir, target, arch, n_layers, attention):  # noqa: F811
    model = target if (arch, attention) == ("llama", "sdpa") else make_target(arch)
    model.set_attn_implementation(attention)  # eager takes an additive mask, sdpa a bool one
    data = LabelledData(data_dir)
    batch, seqs = sampled(data, seed=3)
    n_ctx = batch.positions[:, ::BLOCK].max(1).values
    assert n_ctx[0] != n_ctx[1] and batch.ctx_states.shape[1] == int(n_ctx.max())  # one row is padded
    exact, block, ref = exact_inputs(model, data, batch, seqs)
    top = FrozenTop(model, n_layers, INDICES)
    assert top.input_index == 6 - n_layers and top.n_layers == n_layers
    logp = top.log_probs(exact, block)
    assert logp.shape == ref.shape and torch.isfinite(logp).all()
    assert (logp - ref).abs().max() < 1e-5
    # the check sees positions and the mask: one position off, or a block seeing the context after its anchor
    shifted = top.log_probs(dataclasses.replace(exact, positions=exact.positions + 1), block)
    mask = exact.mask.clone()
    mask[:, :, :exact.ctx_states.shape[1]] = True
    peeking = top.log_probs(dataclasses.replace(exact, mask=mask), block)
    assert (shifted - ref).abs().max() > 1e-4 and (peeking - ref).abs().max() > 1e-4
    if arch == "llama":  # the data was labelled by this target: the batch carries its stored top-k
        assert torch.equal(batch.topk_ids[..., 0], ref.argmax(-1))
        assert torch.allclose(batch.topk_logp.float(), ref.gather(-1, batch.topk_ids), atol=2e-3)
        row, j = 1, BLOCK + 2
        pos = int(batch.positions[row, j])
        assert torch.equal(batch.topk_ids[row, j], data.read(seqs[row], "topk_ids", pos, pos + 1)[0].long())


def test_refuses_targets_the_decoder_layers_cannot_run(target):  # noqa: F811
    with pytest.raises(ValueError, match="qwen3_5_text"):
        FrozenTop(tiny_model("qwen3_5"), 1, [3])
    with pytest.raises(ValueError, match="gemma3"):
        FrozenTop(tiny_model("gemma3"), 1, [5])
    with pytest.raises(ValueError, match="decoder_layers=3"):
        FrozenTop(target, 3, INDICES)  # index 3 is not predicted
    with pytest.raises(ValueError, match="decoder_layers"):
        FrozenTop(target, 7, INDICES)


def test_kl_loss_and_agreement():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(2, 3, 7, generator=gen), dim=-1)  # [S, Q, V]
    stored, ids = logp.sort(dim=-1, descending=True)  # the whole vocabulary as the "top-k"
    loss, stats = kl_loss(logp, ids, stored)
    assert abs(loss.item()) < 1e-6 and stats["agree"] == 1.0
    other = torch.log_softmax(torch.randn(2, 3, 7, generator=gen), dim=-1)
    loss, stats = kl_loss(other, ids, stored)
    full = (stored.exp() * (stored - other.gather(-1, ids))).sum(-1).mean()
    assert loss.item() > 0.01 and loss.item() == pytest.approx(full.item(), rel=1e-6) and stats["kl"] == loss.item()
    # truncated to k = 2, not renormalised; agreement = argmax of the prediction vs the stored top-1
    q = torch.tensor([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]]).log()  # [1, 2, 3]
    top_ids = torch.tensor([[[0, 1], [2, 1]]])  # position 0 agrees, position 1 does not (argmax 1, stored 2)
    top_logp = torch.tensor([[[0.5, 0.25], [0.4, 0.35]]]).log().half()
    loss, stats = kl_loss(q, top_ids, top_logp)
    p = top_logp.float().exp()
    want = ((p[0, 0, 0] * math.log(p[0, 0, 0] / 0.6) + p[0, 0, 1] * math.log(p[0, 0, 1] / 0.3))
            + (p[0, 1, 0] * math.log(p[0, 1, 0] / 0.3) + p[0, 1, 1] * math.log(p[0, 1, 1] / 0.5))) / 2
    assert loss.item() == pytest.approx(float(want), rel=1e-5) and stats["agree"] == 0.5
    # a stored probability of 0 adds nothing (no NaN)
    loss, _ = kl_loss(q, top_ids, torch.tensor([[[0.5, 0.0], [0.4, 0.0]]]).log())
    assert torch.isfinite(loss)


def test_kl_trains_the_adapter_only_and_lowers_the_kl(data_dir, target):  # noqa: F811
    data = LabelledData(data_dir)
    torch.manual_seed(0)
    ad = Adapter.from_target(target, INDICES).float().train()
    top = FrozenTop(target, 2, INDICES)
    batch, seqs = sampled(data, seed=0, n_anchors=4, spread=4)
    # The target's full law as the stored one: the tiny target's is flat, so its top-4 (the data's) holds ~5% of
    # the mass, and the truncated KL would mostly reward moving mass into the top-4 (its minimum is P log P < 0).
    exact, _, ref = exact_inputs(target, data, batch, seqs)
    logp, ids = ref.sort(dim=-1, descending=True)
    batch = dataclasses.replace(exact, topk_ids=ids, topk_logp=logp)
    s = AdapterTrainSettings(kl_weight=1.0, state_weight=0.0, decoder_layers=2)
    opt = torch.optim.AdamW(ad.parameters(), lr=3e-3)
    history = []
    for step in range(12):
        loss, stats = training_loss(ad, batch, torch.ones(2), s, top)
        assert loss.item() == pytest.approx(stats["kl"], rel=1e-6)  # state_weight 0: the KL alone
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = [p.grad for p in ad.parameters()]
            assert all(g is not None and torch.isfinite(g).all() for g in grads)
            assert sum(float(g.abs().sum()) for g in grads) > 0
            assert all(p.grad is None for p in target.parameters())  # read, never trained
            assert all(p.requires_grad for p in target.parameters())  # and its flags left alone
        opt.step()
        history.append(stats)
    assert history[-1]["kl"] < 0.25 * history[0]["kl"], history
    assert history[-1]["agree"] >= history[0]["agree"]


def test_train_with_kl_logs_and_resumes(data_dir, target, tmp_path):  # noqa: F811
    data = LabelledData(data_dir)
    kl = dict(kl_weight=0.5, state_weight=0.7, decoder_layers=2)
    full = train_adapter(target, data, tmp_path / "a", AdapterTrainSettings(steps=4, **kl, **RUN))
    for h in full["history"]:
        assert h["loss"] == pytest.approx(0.7 * h["state_loss"] + 0.5 * h["kl"], rel=1e-5)
        assert math.isfinite(h["kl"]) and 0.0 <= h["agree"] <= 1.0
    assert full == json.loads((tmp_path / "a" / "report.json").read_text())
    assert {"kl", "agree", "state_loss"} <= set(full["last50_mean"])
    assert full["settings"]["kl_weight"] == 0.5 and (tmp_path / "a" / "loss.png").exists()
    train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=2, **kl, **RUN))
    with pytest.raises(ValueError, match="decoder_layers"):  # the KL's depth is part of the loss
        train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=4, decoder_layers=4, **RUN), resume=True)
    resumed = train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=4, **RUN), resume=True)
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in full["history"]], rel=1e-5)
    assert Adapter.load(tmp_path / "b", target).config.decoder_layers == 2


def test_without_kl_the_loss_is_the_state_loss(data_dir, target, tmp_path):  # noqa: F811
    data = LabelledData(data_dir)
    report = train_adapter(target, data, tmp_path / "a", AdapterTrainSettings(steps=1, **RUN))
    assert "kl" not in report["history"][0] and "kl" not in report["last50_mean"]
    torch.manual_seed(0)
    fresh = Adapter.from_target(target, INDICES).float()
    batch = sample_adapter_blocks(data, torch.Generator().manual_seed(0), columns(data, INDICES, H), 2, 2, BLOCK, 4)
    loss, _ = adapter_loss(fresh, batch, torch.tensor(report["loss_scales"]))
    assert report["history"][0]["loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_kl_needs_a_predicted_decoder_depth(data_dir, target, tmp_path):  # noqa: F811
    data = LabelledData(data_dir)
    with pytest.raises(ValueError, match="decoder_layers"):
        train_adapter(target, data, tmp_path / "a", AdapterTrainSettings(steps=1, kl_weight=1.0, **RUN))
    with pytest.raises(ValueError, match="decoder_layers"):  # index 6 - 3 = 3 is not one the adapter predicts
        train_adapter(target, data, tmp_path / "b", AdapterTrainSettings(steps=1, kl_weight=1.0, decoder_layers=3,
                                                                         **RUN))


def test_cli_passes_the_loss_weights(data_dir, target, tmp_path, monkeypatch):  # noqa: F811
    import foresight.models.loading as loading
    import foresight.training.train_adapter as ta
    from foresight.training.__main__ import main

    seen = {}

    def fake_train(tgt, data, out, s, resume=False):
        seen["s"] = s
        return {"steps_done": 0, "last50_mean": {}}

    monkeypatch.setattr(loading, "resolve_target", lambda path: path)
    monkeypatch.setattr(loading, "load_target", lambda path, dtype, device: target)
    monkeypatch.setattr(ta, "train_adapter", fake_train)
    assert main(["train", "adapter", "--data-dir", str(data_dir), "--out", str(tmp_path / "a"), "--kl-weight", "0.5",
                 "--state-weight", "2", "--decoder-layers", "2"]) == 0
    assert (seen["s"].kl_weight, seen["s"].state_weight, seen["s"].decoder_layers) == (0.5, 2.0, 2)
    main(["train", "adapter", "--data-dir", str(data_dir), "--out", str(tmp_path / "b")])
    assert (seen["s"].kl_weight, seen["s"].state_weight) == (0.0, 1.0)
