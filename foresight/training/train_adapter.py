"""Training the hidden-to-hidden adapter (JetSpec++ section 4.2; docs/architecture.md).

A batch: sequences of the labelled data (chosen in proportion to length), several blocks each. A block
starts at an anchor n: its inputs are the TRUE tokens y_n..y_{n+gamma}, its context the TRUE target states of
positions 0..n-1 at the adapter's indices, its targets the true states of positions n..n+gamma. The stages
run stacked as at inference (stage l reads stage l-'s prediction; gradients flow through the chain).

    loss = state_weight * state_loss + kl_weight * KL
    state_loss = mean over indices l of  mean_{blocks, positions} [ SmoothL1(h_hat / s_l, h / s_l)
                                                                    + (1 - cos(h_hat, h)) ]
    KL = mean_{blocks, positions}  sum_{i in top-k} p_i (log p_i - log q_i)      (only with kl_weight > 0)

Per-index normalisation: s_l is a fixed scalar per index, the RMS of the true states at l over a sample of
the data (positions >= 1, estimated once at the start and kept in the training state). Residual-stream
norms grow with depth (SmolLM2: RMS ~1 at index 3, tens at 15-27, outlier channels to 2.6e4), so raw Smooth
L1 would be dominated by the deepest index; divided by s_l every index's error is in units of its own
typical scale. The cosine term is scale-free by construction.

The KL term (training/adapter_kl.py) is on what the foresight decoder serves: p is the target's stored top-k
next-token law at each block position, q the law the target's top `decoder_layers` layers + final norm + LM
head (frozen: the decoder's own) give on the predicted states at index L - decoder_layers, attending to keys/
values made from the true context. The state loss alone leaves the error the LM head reads: with a 3-layer
decoder on SmolLM2 (index 27) the last few hundredths of cosine error become a different next token.
kl_weight = 0 (the default) is the state loss alone, with no decoder pass.

Also logged: per-index cosine, and the fraction of the "copy" gap recovered,
1 - MSE(pred) / MSE(copy), where "copy" predicts every block position with the true state of position n-1
(the last verified state) -- the baseline of the paper's appendix A.

Hybrid targets (Qwen3.5, Qwen3-Next): a stage layer copied from a Gated DeltaNet layer has no mask to hide
the context after a block's anchor. `Adapter.forward_blocks` runs its mixer over each row's TRUE context in
segments ending at the row's distinct anchors, carrying the state (gradients flow through the chain), then
every block of the batch from its own start state at once: one mixer call per distinct anchor, row and
linear layer, on top of the blocks' pass. It reads the blocks' layout (equal contiguous blocks, each seeing a
context prefix) from the mask `sample_adapter_blocks` builds and refuses any other.

AdamW, warmup / constant / cosine decay (`lr_at` of the drafter), seeded: the batch of step t depends only
on (seed, t), so a resumed run sees the same batches as an uninterrupted one. `time_budget_s` cuts the steps
to what fits a wall-clock budget, as the drafter's does (`run_files.StepBudget`; the schedule follows the cut
count). The output folder is the checkpoint (config.json + model.safetensors, fp16) plus report.json,
loss.png and train_state.pt.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.adapter import Adapter, AdapterConfig, default_adapter_indices
from .adapter_kl import FrozenTop, kl_loss
from .dataset import LabelledData, sample_anchors
from .run_files import STATE_FILE, StepBudget, open_run, save_state, tail_mean, write_report
from .train_drafter import lr_at



@dataclass(slots=True)
class AdapterTrainSettings:
    steps: int = 4000
    batch_seqs: int = 4  # sequences per step
    anchors: int = 8  # blocks per sequence
    block_size: int = 16  # gamma + 1
    spread: int = 4  # anchors of a sequence lie within spread * block positions (they share one context)
    layers_per_stage: int = 1
    bottom_layers: int | None = None  # depth of the bottom stage (default layers_per_stage); see Adapter.from_target
    target_indices: list[int] | None = None  # default: the data's raw indices below the final norm
    decoder_layers: int | None = None  # the decoder depth to serve it with (recorded), and the KL's depth
    init: str | None = None  # an adapter checkpoint to start from (its stages and indices), instead of the target
    deepen_top: int = 0  # layers added to the top stage below its own, each starting as the identity
    train_top_only: bool = False  # freeze every stage but the top one (its input distribution stays fixed)
    lr: float = 2e-4  # the stages start from target layers: a fine-tune, not training from scratch
    warmup: int = 100
    decay_frac: float = 0.25
    weight_decay: float = 0.0  # decay would pull the copied target weights toward 0
    grad_clip: float = 1.0
    smooth_l1_beta: float = 1.0
    state_weight: float = 1.0  # weight of the state loss (Smooth L1 + cosine)
    kl_weight: float = 0.0  # weight of the KL through the decoder's top layers (0: none; needs decoder_layers)
    ckpt_every: int = 200
    seed: int = 0
    device: str = "cpu"
    time_budget_s: float = 0.0  # > 0: after BUDGET_PROBE steps, cut `steps` to what fits (run_files.StepBudget)


@dataclass(slots=True)
class AdapterBatch:
    ctx_states: torch.Tensor  # [S, T, F] true states of positions 0..T-1 (adapter indices), zero-padded
    tokens: torch.Tensor  # [S, Q] true block tokens (Q = anchors * block)
    positions: torch.Tensor  # [S, Q]
    mask: torch.Tensor  # [S, Q, T+Q] bool: context positions < the block's anchor, causal inside the block
    targets: torch.Tensor  # [S, Q, F] true states of the block positions
    copy: torch.Tensor  # [S, Q, F] true state of the position before the block's anchor (baseline)
    topk_ids: torch.Tensor  # [S, Q, k] long: the target's top-k next tokens at the block positions
    topk_logp: torch.Tensor  # [S, Q, k] fp16: their log-probabilities

    def to(self, device) -> "AdapterBatch":
        return AdapterBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def columns(data: LabelledData, indices: list[int], hidden: int) -> torch.Tensor:
    """Column ids of `indices` in the data's concatenated hidden states."""
    layers = list(data.meta["layers"])
    missing = [i for i in indices if i not in layers]
    if missing:
        raise ValueError(f"data dir {data.path} holds indices {layers}; adapter needs {missing}")
    return torch.cat([torch.arange(layers.index(i) * hidden, (layers.index(i) + 1) * hidden) for i in indices])


def sample_adapter_blocks(data: LabelledData, gen: torch.Generator, cols: torch.Tensor, n_seqs: int, n_anchors: int,
                          block: int, spread: int = 4) -> AdapterBatch:
    seqs, _, anchor_rows = sample_anchors(data, gen, n_seqs, n_anchors, block, spread)
    parts = []
    for i, anchors in zip(seqs.tolist(), anchor_rows.tolist()):
        lo, hi = min(anchors), max(anchors) + block
        states = data.read(i, "hidden", 0, hi)[:, cols]  # positions 0 .. last block end
        top = (data.read(i, "topk_ids", lo, hi), data.read(i, "topk_logp", lo, hi))  # positions lo .. hi-1
        parts.append((data.seq_tokens(i), anchors, states, top))
    t = max(max(a) for _, a, _, _ in parts)
    q, f = n_anchors * block, len(cols)
    out = dict(ctx_states=torch.zeros(n_seqs, t, f, dtype=torch.float16), tokens=torch.zeros(n_seqs, q, dtype=torch.long),
               positions=torch.zeros(n_seqs, q, dtype=torch.long), mask=torch.zeros(n_seqs, q, t + q, dtype=torch.bool),
               targets=torch.zeros(n_seqs, q, f, dtype=torch.float16), copy=torch.zeros(n_seqs, q, f, dtype=torch.float16))
    k = parts[0][3][0].shape[1]
    out.update(topk_ids=torch.zeros(n_seqs, q, k, dtype=torch.long),
               topk_logp=torch.zeros(n_seqs, q, k, dtype=torch.float16))
    idx = torch.arange(block)
    causal = torch.ones(block, block, dtype=torch.bool).tril()
    ctx_pos = torch.arange(t)
    for row, (tokens, anchors, states, (top_ids, top_logp)) in enumerate(parts):
        n_ctx, lo = max(anchors), min(anchors)
        out["ctx_states"][row, :n_ctx] = states[:n_ctx]
        for a, n in enumerate(anchors):
            sl = slice(a * block, (a + 1) * block)
            out["tokens"][row, sl] = tokens[n:n + block]
            out["positions"][row, sl] = n + idx
            out["mask"][row, sl, :t] = (ctx_pos < n)[None]
            out["mask"][row, sl, t + a * block:t + (a + 1) * block] = causal
            out["targets"][row, sl] = states[n:n + block]
            out["copy"][row, sl] = states[n - 1]
            out["topk_ids"][row, sl] = top_ids[n - lo:n - lo + block].long()
            out["topk_logp"][row, sl] = top_logp[n - lo:n - lo + block]
    return AdapterBatch(**out)


def estimate_scales(data: LabelledData, cols: torch.Tensor, n_idx: int, seed: int, n_seqs: int = 32) -> list[float]:
    """Per index, the RMS of the true states over positions >= 1 of a few sequences."""
    gen = torch.Generator().manual_seed(seed + 7)
    seqs = torch.randperm(len(data), generator=gen)[:n_seqs].tolist()
    acc, count = torch.zeros(n_idx, dtype=torch.float64), 0
    for i in seqs:
        n = int(data.lengths[i])
        x = data.read(i, "hidden", 1, n)[:, cols].double().unflatten(-1, (n_idx, -1))  # [N, n_idx, H]
        acc += x.pow(2).mean(-1).sum(0)
        count += x.shape[0]
    return [float(v) for v in (acc / max(count, 1)).sqrt()]


def adapter_loss(model: Adapter, batch: AdapterBatch, scales: torch.Tensor, beta: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The state loss of the adapter's predictions for the batch (module docstring)."""
    pred = model.forward_blocks(batch.ctx_states, batch.tokens, batch.positions, batch.mask)  # [S, Q, F]
    return state_loss(pred, batch, scales, model.config.hidden_size, beta)


def state_loss(pred: torch.Tensor, batch: AdapterBatch, scales: torch.Tensor, hidden: int,
               beta: float = 1.0) -> tuple[torch.Tensor, dict]:
    """pred [S, Q, n_idx * H] -> (Smooth L1 + cosine distance, averaged over indices; per-index stats)."""
    n_idx = len(scales)
    shape = (n_idx, hidden)
    p = pred.float().unflatten(-1, shape)  # [S, Q, n_idx, H]
    t = batch.targets.float().unflatten(-1, shape)
    s = scales.to(p.device)[:, None]
    l1 = F.smooth_l1_loss(p / s, t / s, reduction="none", beta=beta).mean(-1)  # [S, Q, n_idx]
    cos = F.cosine_similarity(p, t, dim=-1)  # [S, Q, n_idx]
    per_index = (l1 + 1 - cos).mean((0, 1))  # [n_idx]
    loss = per_index.mean()
    with torch.no_grad():
        c = batch.copy.float().unflatten(-1, shape)
        mse = ((p - t) / s).pow(2).mean((0, 1, 3))
        mse_copy = ((c - t) / s).pow(2).mean((0, 1, 3))
        stats = {"cos": [float(v) for v in cos.mean((0, 1))], "smooth_l1": [float(v) for v in l1.mean((0, 1))],
                 "gap_recovered": [float(v) for v in 1 - mse / mse_copy.clamp_min(1e-12)]}
    return loss, stats


def training_loss(model: Adapter, batch: AdapterBatch, scales: torch.Tensor, s: AdapterTrainSettings,
                  top: FrozenTop | None = None) -> tuple[torch.Tensor, dict]:
    """state_weight * state loss (+ kl_weight * KL through `top`, the decoder's frozen layers, when given)."""
    pred = model.forward_blocks(batch.ctx_states, batch.tokens, batch.positions, batch.mask)  # [S, Q, F]
    loss, stats = state_loss(pred, batch, scales, model.config.hidden_size, s.smooth_l1_beta)
    if top is None:
        return s.state_weight * loss, stats
    kl, kl_stats = kl_loss(top.log_probs(batch, pred), batch.topk_ids, batch.topk_logp)
    return s.state_weight * loss + s.kl_weight * kl, {"state_loss": loss.item(), **kl_stats, **stats}


def build_adapter(target, data: LabelledData, s: AdapterTrainSettings) -> Adapter:
    if s.init is not None:
        model = Adapter.load(s.init, target)  # float32
        s.target_indices = model.target_indices
        return model.deepened(target, s.deepen_top) if s.deepen_top else model
    if s.deepen_top:
        raise ValueError("deepen_top adds layers to a trained adapter: give init")
    n_layers = target.config.num_hidden_layers
    indices = s.target_indices or [i for i in data.meta["layers"] if i < n_layers] or default_adapter_indices(n_layers)
    s.target_indices = list(indices)
    model = Adapter.from_target(target, indices, s.layers_per_stage, s.bottom_layers)
    model.config.target_name = data.meta.get("target_name", model.config.target_name)
    return model.float()


def train_adapter(target, data: LabelledData, out: Path, s: AdapterTrainSettings, resume: bool = False,
                  log=print) -> dict:
    out = Path(out)
    state, s = open_run(out, resume, s)
    if state is not None and s.kl_weight:  # the KL's decoder depth is part of the loss: a resumed run keeps its own
        stored = state["settings"].get("decoder_layers")
        if s.decoder_layers not in (None, stored):
            raise ValueError(f"decoder_layers sets the KL term: this run trains with {stored}, not {s.decoder_layers}")
        s.decoder_layers = stored
    device = torch.device(s.device)
    torch.manual_seed(s.seed)
    if state is None:
        model = build_adapter(target, data, s)
    else:
        model = Adapter(AdapterConfig.from_dict(state["config"]), target).float()
        model.load_state_dict(state["model"])
    model = model.to(device).train()
    if s.train_top_only:
        model.stages[:-1].requires_grad_(False)
    top = FrozenTop(target, s.decoder_layers, model.target_indices) if s.kl_weight else None  # the KL's decoder
    cols = columns(data, model.target_indices, model.config.hidden_size)
    scales = state["scales"] if state is not None else estimate_scales(data, cols, len(model.target_indices), s.seed)
    scales_t = torch.tensor(scales, dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr, betas=(0.9, 0.95),
                            weight_decay=s.weight_decay)
    history: list[dict] = []
    step = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        history, step = state["history"], state["step"]
        log(f"[train] resumed at step {step} from {out / STATE_FILE}")
    model.config.decoder_layers = s.decoder_layers
    # a warm start keeps its recipe under "init" (a resumed run finds it there already)
    started_from = (model.config.extra if state is None else model.config.extra.get("init")) if s.init else None
    model.config.extra = {**({"init": started_from} if started_from else {}), "train": asdict(s), "loss_scales": scales,
                          "data": {"tokens": data.num_tokens, "sequences": len(data), "path": str(data.path)}}
    bar = tqdm(total=s.steps, initial=step, unit="step", desc="train adapter", dynamic_ncols=True)
    budget = StepBudget(s, step, time.perf_counter(), bar)
    while step < s.steps:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        batch = sample_adapter_blocks(data, gen, cols, s.batch_seqs, s.anchors, s.block_size, s.spread).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        loss, stats = training_loss(model, batch, scales_t, s, top)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        step += 1
        budget.step_done(step, time.perf_counter())
        history.append({"step": step, "loss": loss.item(), **stats, "grad_norm": float(grad_norm),
                        "lr": opt.param_groups[0]["lr"], "s": time.perf_counter() - t0})
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", cos="/".join(f"{c:.3f}" for c in stats["cos"]),
                        gap="/".join(f"{g:.2f}" for g in stats["gap_recovered"]),
                        **({"agree": f"{stats['agree']:.3f}"} if top is not None else {}))
        if step % s.ckpt_every == 0 or step == s.steps:
            save_all(model, opt, s, scales, step, history, out)
    bar.close()
    if not (out / "report.json").exists() or json.loads((out / "report.json").read_text())["steps_done"] != step:
        save_all(model, opt, s, scales, step, history, out)
    return json.loads((out / "report.json").read_text())


def save_all(model: Adapter, opt, s: AdapterTrainSettings, scales: list[float], step: int, history: list[dict],
             out: Path) -> None:
    """The checkpoint folder (fp16), the resumable state, and the report."""
    model.config.extra["steps_done"] = step
    model.config.extra["train"] = asdict(s)  # as run: a time budget may have cut `steps`
    model.save(out)
    save_state(out, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                     "settings": asdict(s), "config": model.config.to_dict(), "scales": scales})
    report = {"steps_done": step, "settings": asdict(s), "target_indices": model.target_indices,
              "loss_scales": scales, "params": model.num_trainable(), "data": model.config.extra.get("data"),
              "last50_mean": tail_mean(history, ("loss", "s", "cos", "smooth_l1", "gap_recovered")
                                       + (("state_loss", "kl", "agree") if s.kl_weight else ()))}
    curves = []
    for j, ell in enumerate(model.target_indices):
        curves.append((f"cos, index {ell}", [h["cos"][j] for h in history], "-"))
        curves.append((f"copy gap recovered, {ell}", [h["gap_recovered"][j] for h in history], "--"))
    if s.kl_weight:
        curves.append((f"decoder top-1 = target's, {s.decoder_layers} layers", [h["agree"] for h in history], ":"))
    kl = f" + {s.kl_weight:g} KL" if s.kl_weight else ""
    write_report(out, report, history, "Smooth L1 + cosine distance" + kl, "loss", curves,
                 "agreement with the true states" + (" and next tokens" if s.kl_weight else ""))


__all__ = ["AdapterTrainSettings", "AdapterBatch", "sample_adapter_blocks", "adapter_loss", "state_loss",
           "training_loss", "estimate_scales", "build_adapter", "train_adapter"]
