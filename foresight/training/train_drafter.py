"""Training the draft model: forward KL to the target at every block position (JetSpec++ section 4.3).

    loss = sum_{blocks, i} 0.8^i KL(p_target(. | true prefix up to n+i) || q_draft(. | block inputs <= i))
           / sum 0.8^i
with the target's top-k (renormalised over the drafter's vocabulary subset) standing in for p.
AdamW, linear warmup, constant, cosine decay to 0 over the last 25% of the steps. Seeded: the batch of
step t depends only on (seed, t), so a resumed run sees the same batches as an uninterrupted one.
With `holdout` > 0 a share of the sequences is never trained on; before the first step and at each
checkpoint the loss on fixed batches of them is set beside the loss on fixed batches of training sequences
(a gap that grows shows memorising: more data, not more steps, would help).
The output folder is the checkpoint (config.json + model.safetensors, fp16) plus report.json,
loss.png and train_state.pt (fp32 weights + optimizer, for --resume; not meant for git).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.draft_model import DraftConfig, DraftModel, SharedWeights
from ..models.loading import cpu_supports_bf16
from .dataset import BlockBatch, LabelledData, choose_vocab_subset, sample_blocks
from .draft_init import initialise
from .run_files import STATE_FILE, StepBudget, decay_start, open_run, save_state, tail_mean, write_report


@dataclass(slots=True)
class TrainSettings:
    steps: int = 6000
    batch_seqs: int = 4  # sequences per step
    anchors: int = 16  # blocks per sequence
    block_size: int = 16
    # Block positions the loss covers (0 = all of them). A block's output i reads only inputs <= i (causal inside
    # the block), so the first P positions of a block train exactly as in a whole one: with P = 8, the default
    # verification block, a step holds half the queries and drops the positions 8.. (14 % of the loss weight).
    loss_positions: int = 0
    num_layers: int = 3
    context_window: int = 512
    vocab_subset: int = 14500  # 0 = full vocabulary
    lr: float = 1e-3
    warmup: int = 200
    decay_frac: float = 0.25  # cosine decay over this last fraction of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    position_decay: float = 0.8
    ckpt_every: int = 200
    seed: int = 0
    device: str = "cpu"
    # Autocast matmuls to bf16 on CUDA and on CPUs with native bf16 (avx512_bf16 / AMX): a step of 8 sequences x
    # 16 blocks, forward and backward, 2 threads of an AMD EPYC with avx512_bf16: 0.75 s against 1.6 s in fp32.
    # A CPU that emulates bf16 trains in fp32 (autocast was measured 18x slower than fp32 on one).
    bf16: bool = True
    time_budget_s: float = 0.0  # > 0: after BUDGET_PROBE steps, cut `steps` to what fits (the schedule follows)
    init: str = "random"  # random | target (its top attention layers) | a checkpoint folder (warm start); see draft_init
    holdout: float = 0.0  # share of the sequences kept out of training and scored at each checkpoint (0 = none)


EVAL_BATCHES = 8  # fixed batches per split at each checkpoint (a batch's loss varies by ~0.2)
EVAL_SEED = 1 << 40  # their generators' seeds: apart from the training steps' (seed * 1_000_003 + step)


def trained_positions(s: TrainSettings) -> int:
    """The block positions a training block holds: `loss_positions`, or the whole block."""
    if s.loss_positions and not 3 <= s.loss_positions <= s.block_size:
        raise ValueError(f"loss_positions must lie in [3, block_size={s.block_size}] (or 0 = all)")
    return s.loss_positions or s.block_size


def lr_at(step: int, s: TrainSettings) -> float:
    """Warmup, constant, cosine decay to 0 over the last `decay_frac` of the steps."""
    warmup = min(s.warmup, max(1, s.steps // 10))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    start = decay_start(s)
    if step < start:
        return s.lr
    return s.lr * 0.5 * (1 + math.cos(math.pi * (step - start) / max(1, s.steps - start)))


def kl_loss(model: DraftModel, batch: BlockBatch, bf16: bool = False) -> tuple[torch.Tensor, dict]:
    """Weighted forward KL; also the top-1 agreement and, on fully noised blocks, the length of the
    prefix whose argmax matches the target's (a J0 acceptance proxy)."""
    device_type = batch.tokens.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model.forward_blocks(batch.ctx_states.float(), batch.ctx_positions, batch.tokens, batch.block_idx,
                                      batch.positions, batch.anchor_index, batch.mask)
        logits = model.logits(hidden)  # [S, Q, V'] float32
    logq = torch.log_softmax(logits.float(), dim=-1)
    valid = batch.target_ids >= 0  # [S, Q, k]
    p = batch.target_logp.exp() * valid
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    lq = logq.gather(-1, batch.target_ids.clamp_min(0))
    kl = (p * (torch.log(p.clamp_min(1e-12)) - lq)).sum(-1)  # [S, Q]
    loss = (kl * batch.weights).sum() / batch.weights.sum()
    with torch.no_grad():
        match = logq.argmax(-1) == batch.target_ids[..., 0]  # [S, Q]
        block = int(batch.block_idx.max()) + 1
        m = match.view(-1, block)
        noised = batch.clean.view(-1, block)[:, 0] == 0
        j0_len = m[noised].long().cumprod(-1).sum(-1).float().mean() if noised.any() else torch.tensor(0.0)
        stats = {"kl": float((kl.mean())), "top1": float(match.float().mean()), "j0_len": float(j0_len)}
    return loss, stats


def build_model(target, data: LabelledData, s: TrainSettings) -> DraftModel:
    meta = data.meta
    cfg = DraftConfig.for_target(target.config, target_layers=list(meta["layers"]), num_layers=s.num_layers,
                                 block_size=s.block_size, context_window=s.context_window,
                                 target_name=meta.get("target_name", ""))
    torch.manual_seed(s.seed)
    subset = choose_vocab_subset(data, cfg.vocab_size, s.vocab_subset)
    model = DraftModel(cfg, SharedWeights.from_target(target), subset)
    cfg.extra["init"] = initialise(model, target, s.init)
    return model


def train(target, data: LabelledData, out: Path, s: TrainSettings, resume: bool = False, log=print) -> dict:
    out = Path(out)
    state, s = open_run(out, resume, s)
    device = torch.device(s.device)
    bf16 = s.bf16 and (device.type == "cuda" or cpu_supports_bf16())
    model = build_model(target, data, s) if state is None else _model_from_state(target, data, state, s)
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    history: list[dict] = []
    step = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        history, step = state["history"], state["step"]
        log(f"[train] resumed at step {step} from {out / STATE_FILE}")
    subset_index = vocab_subset_index(model, device)
    model.config.extra.update({"train": asdict(s), "data": {"tokens": data.num_tokens, "sequences": len(data),
                                                            "path": str(data.path)}})
    positions = trained_positions(s)
    held = data.holdout(s.holdout, s.seed) if s.holdout else None
    if held is not None and not held.any():
        raise ValueError(f"holdout={s.holdout} keeps none of the {len(data)} sequences out: raise it")
    trained_seqs = None if held is None else ~held
    evals: list[dict] = state.get("evals", []) if state is not None else []

    def score_splits() -> None:
        evals.append({"step": step, **{name: score_split(model, data, seqs, s, subset_index, bf16)
                                       for name, seqs in (("heldout", held), ("train", trained_seqs))}})

    if held is not None and not evals:
        score_splits()  # before any step: the two splits' own gap, which training then widens or not
    bar = tqdm(total=s.steps, initial=step, unit="step", desc="train drafter", dynamic_ncols=True)
    budget = StepBudget(s, step, time.perf_counter(), bar)
    while step < s.steps:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        batch = sample_blocks(data, gen, s.batch_seqs, s.anchors, positions, s.context_window, subset_index,
                              s.position_decay, device=device, allowed=trained_seqs)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        loss, stats = kl_loss(model, batch, bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        step += 1
        budget.step_done(step, time.perf_counter())
        history.append({"step": step, "loss": loss.item(), **stats, "grad_norm": float(grad_norm),
                        "lr": opt.param_groups[0]["lr"], "s": time.perf_counter() - t0})
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", top1=f"{stats['top1']:.2f}", j0=f"{stats['j0_len']:.2f}")
        if step % s.ckpt_every == 0 or step == s.steps:
            if held is not None:
                score_splits()
            save_all(model, opt, s, step, history, out, evals)
    bar.close()
    if not history or history[-1]["step"] != step or not (out / "report.json").exists():
        save_all(model, opt, s, step, history, out, evals)
    return json.loads((out / "report.json").read_text())


def vocab_subset_index(model: DraftModel, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] each token's index in the drafter's vocabulary subset, -1 outside it (what sample_blocks takes)."""
    index = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device=device)
    index[model.vocab_subset.to(device)] = torch.arange(len(model.vocab_subset), device=device)
    return index


def score_split(model: DraftModel, data: LabelledData, seqs: torch.Tensor, s: TrainSettings,
                subset_index: torch.Tensor, bf16: bool, batches: int = EVAL_BATCHES) -> dict:
    """Loss, top-1 and the J0 proxy of `model`, means over `batches` fixed batches (the same at every
    checkpoint) drawn from the sequences `seqs` ([sequences] bool)."""
    model.eval()
    totals = {"loss": 0.0, "top1": 0.0, "j0_len": 0.0}
    with torch.no_grad():
        for k in range(batches):
            batch = sample_blocks(data, torch.Generator().manual_seed(EVAL_SEED + k), s.batch_seqs, s.anchors,
                                  trained_positions(s), s.context_window, subset_index, s.position_decay,
                                  device=subset_index.device, allowed=seqs)
            loss, stats = kl_loss(model, batch, bf16)
            for key, value in (("loss", float(loss)), ("top1", stats["top1"]), ("j0_len", stats["j0_len"])):
                totals[key] += value / batches
    model.train()
    return totals


def _model_from_state(target, data: LabelledData, state: dict, s: TrainSettings) -> DraftModel:
    cfg = DraftConfig.from_dict(state["config"])
    model = DraftModel(cfg, SharedWeights.from_target(target), state["vocab_subset"])
    model.load_state_dict(state["model"])
    return model


def save_all(model: DraftModel, opt, s: TrainSettings, step: int, history: list[dict], out: Path,
             evals: list[dict]) -> None:
    """The checkpoint folder (fp16), the resumable state, and the report (with the held-out scores `evals`)."""
    model.config.extra["steps_done"] = step
    model.config.extra["train"] = asdict(s)  # as run: a time budget may have cut `steps`
    model.save(out)
    save_state(out, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "history": history, "evals": evals, "settings": asdict(s), "config": model.config.to_dict(),
                     "vocab_subset": model.vocab_subset.cpu()})
    report = {"steps_done": step, "settings": asdict(s), "params": model.num_trainable(),
              "vocab_subset": len(model.vocab_subset), "data": model.config.extra.get("data"),
              "last50_mean": tail_mean(history, ("loss", "top1", "j0_len", "s")), "evals": evals}
    curves = [("top-1 agreement", [h["top1"] for h in history], "-"),
              ("J0 matched prefix (noised blocks)", [h["j0_len"] for h in history], "-")]
    points = [(f"{name} sequences (fixed batches)", [e["step"] for e in evals], [e[name]["loss"] for e in evals])
              for name in ("heldout", "train") if evals]
    write_report(out, report, history, "forward KL", "loss (weighted KL)", curves, "agreement with the target",
                 points)


__all__ = ["TrainSettings", "train", "kl_loss", "lr_at", "build_model", "score_split", "vocab_subset_index"]
