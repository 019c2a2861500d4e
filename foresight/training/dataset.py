"""Labelled sequences -> training blocks (JetSpec++ section 4.3, "Training").

A block starts at an anchor position n of a sequence: input 0 is the true token y_n, inputs 1..m the
true tokens after it (the clean prefix), the rest noise tokens drawn from the sequence's own context
y_0..y_n; m = 0 half the time, else m ~ U{1..block-2}. Output i is trained toward the target's
distribution at position n+i (the law of y_{n+i+1} given the true prefix), with weight decay**i.
The block attends to the target states of the window of positions before n.

Blocks are grouped by sequence: all anchors of one sequence share one context tensor, and a mask lets
each block see only its own context window and, causally, its own block.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from .labelling import META, iter_shards


class LabelledData:
    """All shards of a data dir, read lazily (only the slices a batch needs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / META).read_text())
        self.handles = [safe_open(str(p), framework="pt") for p in iter_shards(self.path)]
        self.tokens = [h.get_tensor("tokens") for h in self.handles]
        self.index: list[tuple[int, int, int]] = []  # (shard, start, length)
        for shard, h in enumerate(self.handles):
            off = h.get_tensor("offsets").tolist()
            self.index += [(shard, a, b - a) for a, b in zip(off[:-1], off[1:])]
        self.lengths = torch.tensor([n for _, _, n in self.index], dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def seq_tokens(self, i: int) -> torch.Tensor:
        shard, start, n = self.index[i]
        return self.tokens[shard][start:start + n].long()

    def read(self, i: int, key: str, lo: int, hi: int) -> torch.Tensor:
        shard, start, _ = self.index[i]
        return self.handles[shard].get_slice(key)[start + lo:start + hi]

    def vocab_scores(self, vocab_size: int) -> torch.Tensor:
        """How often each token occurs in the data (as a token or the target's top-1), plus a small weight
        for appearing in the target's top-k -- the ranking for the drafter's vocabulary subset."""
        score = torch.zeros(vocab_size, dtype=torch.float64)
        for h, toks in zip(self.handles, self.tokens):
            top = h.get_tensor("topk_ids").long()
            score += torch.bincount(toks.long(), minlength=vocab_size)[:vocab_size].double()
            score += torch.bincount(top[:, 0], minlength=vocab_size)[:vocab_size].double()
            score += 1e-3 * torch.bincount(top.flatten(), minlength=vocab_size)[:vocab_size].double()
        return score


def choose_vocab_subset(data: LabelledData, vocab_size: int, size: int) -> torch.Tensor | None:
    """The `size` highest-scoring tokens (sorted ids), or None for the full vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    score = data.vocab_scores(vocab_size)
    seen = int((score > 0).sum())
    keep = torch.topk(score, min(size, max(seen, 1))).indices
    return keep.sort().values


@dataclass(slots=True)
class BlockBatch:
    ctx_states: torch.Tensor  # [S, T, F] target states of each sequence's context span
    ctx_positions: torch.Tensor  # [S, T]
    tokens: torch.Tensor  # [S, Q] block inputs (Q = anchors * block)
    block_idx: torch.Tensor  # [S, Q]
    positions: torch.Tensor  # [S, Q]
    anchor_index: torch.Tensor  # [S, Q] index into T of the state before the anchor
    mask: torch.Tensor  # [S, Q, T+Q] bool
    target_ids: torch.Tensor  # [S, Q, k] index into the drafter's vocabulary subset, -1 = outside it
    target_logp: torch.Tensor  # [S, Q, k] the target's top-k log-probabilities
    weights: torch.Tensor  # [S, Q]
    clean: torch.Tensor  # [S, Q] clean prefix length m of the query's block

    def to(self, device) -> "BlockBatch":
        return BlockBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def sample_blocks(data: LabelledData, gen: torch.Generator, n_seqs: int, n_anchors: int, block: int, window: int,
                  subset_index: torch.Tensor, decay: float = 0.8, spread: int = 4) -> BlockBatch:
    """`n_seqs` sequences (chosen in proportion to length), `n_anchors` blocks each, anchors within a
    span of `spread * block` positions so their contexts overlap and share one tensor."""
    if block < 3:
        raise ValueError("block must be >= 3")
    usable = (data.lengths - block).clamp(min=0)
    if float(usable.sum()) <= 0:
        raise ValueError(f"no labelled sequence is longer than the block ({block})")
    seqs = torch.multinomial(usable, n_seqs, replacement=True, generator=gen).tolist()
    parts = [_sequence_blocks(data, i, gen, n_anchors, block, window, spread) for i in seqs]
    t = max(p["states"].shape[0] for p in parts)
    q = n_anchors * block
    s = len(parts)
    f = parts[0]["states"].shape[1]
    k = parts[0]["topk_ids"][0].shape[-1]
    out = dict(ctx_states=torch.zeros(s, t, f, dtype=torch.float16), ctx_positions=torch.zeros(s, t, dtype=torch.long),
               tokens=torch.zeros(s, q, dtype=torch.long), positions=torch.zeros(s, q, dtype=torch.long),
               anchor_index=torch.zeros(s, q, dtype=torch.long), mask=torch.zeros(s, q, t + q, dtype=torch.bool),
               target_ids=torch.zeros(s, q, k, dtype=torch.long), target_logp=torch.zeros(s, q, k),
               clean=torch.zeros(s, q, dtype=torch.long))
    idx = torch.arange(block)
    causal = torch.ones(block, block, dtype=torch.bool).tril()
    for row, p in enumerate(parts):
        n_ctx = p["states"].shape[0]
        out["ctx_states"][row, :n_ctx] = p["states"]
        out["ctx_positions"][row, :n_ctx] = p["c0"] + torch.arange(n_ctx)
        for a, n in enumerate(p["anchors"]):
            sl = slice(a * block, (a + 1) * block)
            out["tokens"][row, sl] = p["inputs"][a]
            out["positions"][row, sl] = n + idx
            out["anchor_index"][row, sl] = n - 1 - p["c0"]
            out["clean"][row, sl] = p["clean"][a]
            ctx_pos = p["c0"] + torch.arange(n_ctx)
            out["mask"][row, sl, :n_ctx] = ((ctx_pos < n) & (ctx_pos >= n - window))[None]
            out["mask"][row, sl, t + a * block:t + (a + 1) * block] = causal
            out["target_ids"][row, sl] = subset_index[p["topk_ids"][a]]
            out["target_logp"][row, sl] = p["topk_logp"][a]
    block_idx = idx.repeat(n_anchors).expand(s, q)
    weights = (decay ** block_idx.double()).float()
    return BlockBatch(block_idx=block_idx.contiguous(), weights=weights, **out)


def pick_anchors(length: int, gen: torch.Generator, n_anchors: int, block: int, spread: int) -> tuple[int, int, list[int]]:
    """`n_anchors` anchor positions in [lo, hi), a span of at most `spread * block` positions, each with a whole
    block after it (anchor + block - 1 < length) and at least one position before it."""
    last = length - block  # the last anchor whose block targets all exist
    span = spread * block
    lo = int(torch.randint(1, max(2, last - span + 2), (1,), generator=gen))
    hi = min(lo + span, last + 1)
    return lo, hi, torch.randint(lo, hi, (n_anchors,), generator=gen).tolist()


def _sequence_blocks(data: LabelledData, i: int, gen: torch.Generator, n_anchors: int, block: int, window: int,
                     spread: int) -> dict:
    tokens = data.seq_tokens(i)
    lo, hi, anchors = pick_anchors(len(tokens), gen, n_anchors, block, spread)
    c0 = max(0, lo - window)
    c1 = max(anchors)  # context states needed: positions c0 .. max anchor - 1
    topk_ids = data.read(i, "topk_ids", lo, hi + block - 1).long()
    topk_logp = data.read(i, "topk_logp", lo, hi + block - 1).float()
    inputs, clean, tk_ids, tk_logp = [], [], [], []
    for n in anchors:
        m = 0 if float(torch.rand((), generator=gen)) < 0.5 else int(torch.randint(1, block - 1, (1,), generator=gen))
        noise = tokens[torch.randint(0, n + 1, (block,), generator=gen)]
        x = torch.where(torch.arange(block) <= m, tokens[n:n + block], noise)
        inputs.append(x)
        clean.append(m)
        tk_ids.append(topk_ids[n - lo:n - lo + block])
        tk_logp.append(topk_logp[n - lo:n - lo + block])
    return {"states": data.read(i, "hidden", c0, c1), "c0": c0, "anchors": anchors, "inputs": inputs, "clean": clean,
            "topk_ids": tk_ids, "topk_logp": tk_logp}
