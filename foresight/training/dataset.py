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
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from .labelling import META, iter_shards


@dataclass(slots=True)
class ResidentLabels:
    """A labelled set held on one device, shards concatenated (N = all tokens)."""
    tokens: torch.Tensor  # [N] int32
    hidden: torch.Tensor  # [N, F] fp16 target states at the drafter's layers
    topk_ids: torch.Tensor  # [N, k] int32
    topk_logp: torch.Tensor  # [N, k] fp16
    starts: torch.Tensor  # [sequences] offset of each sequence


class LabelledData:
    """All shards of a data dir, read lazily (only the slices a batch needs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / META).read_text())
        self.files = list(iter_shards(self.path))
        self.handles = [safe_open(str(p), framework="pt") for p in self.files]
        self.tokens = [h.get_tensor("tokens") for h in self.handles]
        self.index: list[tuple[int, int, int]] = []  # (shard, start, length)
        for shard, h in enumerate(self.handles):
            off = h.get_tensor("offsets").tolist()
            self.index += [(shard, a, b - a) for a, b in zip(off[:-1], off[1:])]
        self.lengths = torch.tensor([n for _, _, n in self.index], dtype=torch.float64)
        self._resident: ResidentLabels | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def seq_tokens(self, i: int) -> torch.Tensor:
        shard, start, n = self.index[i]
        return self.tokens[shard][start:start + n].long()

    def holdout(self, share: float, seed: int) -> torch.Tensor:
        """[sequences] bool: the sequences kept out of training, about `share` of them. A sequence is held out
        where a hash of (its shard file, its place there, `seed`) falls below `share`: shards are append-only,
        so a run resumed on grown data holds out the same sequences as before, and the same share of the new."""
        if not 0 < share < 1:
            raise ValueError(f"holdout must lie in (0, 1), got {share}")
        places = [0] * len(self.files)
        held = []
        for shard, _, _ in self.index:
            key = f"{self.files[shard].name}:{places[shard]}:{seed}".encode()
            places[shard] += 1
            held.append(zlib.crc32(key) < share * 2**32)
        return torch.tensor(held, dtype=torch.bool)

    def read(self, i: int, key: str, lo: int, hi: int) -> torch.Tensor:
        shard, start, _ = self.index[i]
        return self.handles[shard].get_slice(key)[start + lo:start + hi]

    def resident(self, device: str | torch.device) -> "ResidentLabels":
        """Every shard concatenated into tensors on `device` (loaded once, then cached): the block sampler
        gathers from these. 300k tokens of 4 fp16 states of 576 take 1.4 GB."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        if self._resident is None or self._resident.tokens.device != device:
            self._resident = None  # free the old copy before loading the new one
            parts = {key: [] for key in ("tokens", "hidden", "topk_ids", "topk_logp")}
            for h in self.handles:
                for key in parts:
                    parts[key].append(h.get_tensor(key).to(device))
            self._resident = ResidentLabels(**{key: torch.cat(v) for key, v in parts.items()},
                                            starts=self._starts().to(device))
        return self._resident

    def _starts(self) -> torch.Tensor:
        """[sequences] offset of each sequence in the concatenation of all shards."""
        shard_base = torch.tensor([0] + [len(t) for t in self.tokens]).cumsum(0)
        return torch.tensor([int(shard_base[shard]) + start for shard, start, _ in self.index], dtype=torch.long)

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
                  subset_index: torch.Tensor, decay: float = 0.8, spread: int = 4,
                  device: str | torch.device = "cpu", allowed: torch.Tensor | None = None) -> BlockBatch:
    """`n_seqs` sequences (chosen in proportion to length, among the `allowed` ones: [sequences] bool, None =
    all), `n_anchors` blocks each, anchors within a span of `spread * block` positions so their contexts
    overlap and share one tensor.

    Vectorised over the whole batch on `device`, from the labelled set held resident there (no Python loop
    per block: on a GPU the loop, not the model, bounded the step rate). Random draws come from the CPU
    generator `gen`, so a batch depends only on its seed, whatever the device."""
    if block < 3:
        raise ValueError("block must be >= 3")
    res = data.resident(device)
    seqs, lo, anchors = sample_anchors(data, gen, n_seqs, n_anchors, block, spread, allowed)
    clean = torch.where(torch.rand(n_seqs, n_anchors, generator=gen) < 0.5, 0,
                        1 + _randbelow(gen, (n_seqs, n_anchors), torch.tensor(block - 2)))  # [S, A] m
    noise_at = _randbelow(gen, (n_seqs, n_anchors, block), anchors[..., None] + 1)  # [S, A, B] index <= n
    c0 = (lo - window).clamp(min=0)  # context states: positions c0 .. max anchor - 1
    n_ctx = anchors.max(1).values - c0  # [S]
    t = int(n_ctx.max())
    seqs, anchors, clean, noise_at, c0, n_ctx = (x.to(device) for x in (seqs, anchors, clean, noise_at, c0, n_ctx))
    start = res.starts[seqs]  # [S] flat offset of each sequence
    i = torch.arange(block, device=device)
    cols = torch.arange(t, device=device)
    ctx_valid = cols < n_ctx[:, None]  # [S, T]
    ctx_pos = torch.where(ctx_valid, c0[:, None] + cols, 0)  # [S, T]
    ctx_states = res.hidden[start[:, None] + ctx_pos] * ctx_valid[..., None]  # [S, T, F] fp16
    pos = anchors[..., None] + i  # [S, A, B]
    flat = start[:, None, None] + pos
    inputs = torch.where(i <= clean[..., None], res.tokens[flat], res.tokens[start[:, None, None] + noise_at])
    n = anchors[..., None]  # [S, A, 1]
    sees_ctx = ctx_valid[:, None] & (ctx_pos[:, None] < n) & (ctx_pos[:, None] >= n - window)  # [S, A, T]
    q = n_anchors * block
    block_pos = i.repeat(n_anchors)  # [Q] position of each query in its block
    same_block = torch.arange(q, device=device) // block
    in_block = (same_block[:, None] == same_block[None]) & (block_pos[None] <= block_pos[:, None])
    mask = torch.cat([sees_ctx[:, :, None].expand(-1, -1, block, -1).reshape(n_seqs, q, t),
                      in_block.expand(n_seqs, q, q)], dim=-1)  # [S, Q, T+Q]
    subset_index = subset_index.to(device)
    block_idx = block_pos.expand(n_seqs, q)
    per_query = lambda x: x[..., None].expand(-1, -1, block).reshape(n_seqs, q)  # noqa: E731  [S, A] -> [S, Q]
    return BlockBatch(ctx_states=ctx_states, ctx_positions=ctx_pos, tokens=inputs.reshape(n_seqs, q).long(),
                      block_idx=block_idx.contiguous(), positions=pos.reshape(n_seqs, q),
                      anchor_index=per_query(anchors - 1 - c0[:, None]), mask=mask,
                      target_ids=subset_index[res.topk_ids[flat].long()].reshape(n_seqs, q, -1),
                      target_logp=res.topk_logp[flat].float().reshape(n_seqs, q, -1),
                      weights=(decay ** block_idx.double()).float(), clean=per_query(clean))


def _randbelow(gen: torch.Generator, shape: tuple, bound: torch.Tensor) -> torch.Tensor:
    """Uniform integers in [0, bound) (bound broadcast to shape, each >= 1), from a CPU generator."""
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * bound).long().clamp(max=bound - 1)


def sample_anchors(data: LabelledData, gen: torch.Generator, n_seqs: int, n_anchors: int, block: int,
                   spread: int, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n_seqs` sequences drawn in proportion to their usable length (only `allowed` ones: [sequences] bool,
    None = all), and for each `n_anchors` anchors in a span [lo, lo + spread * block), each with a whole block
    after it (anchor + block - 1 < length) and at least one position before it. Returns (seqs [S], lo [S],
    anchors [S, A]) on the CPU."""
    usable = (data.lengths - block).clamp(min=0)
    if allowed is not None:
        usable = usable * allowed.cpu()
    if float(usable.sum()) <= 0:
        raise ValueError(f"no labelled sequence to draw from is longer than the block ({block})")
    seqs = torch.multinomial(usable, n_seqs, replacement=True, generator=gen)  # [S]
    last = data.lengths[seqs].long() - block  # the last anchor whose block targets all exist
    span = spread * block
    lo = 1 + _randbelow(gen, (n_seqs,), (last - span + 2).clamp(min=2) - 1)  # [S]
    hi = torch.minimum(lo + span, last + 1)
    anchors = lo[:, None] + _randbelow(gen, (n_seqs, n_anchors), (hi - lo)[:, None])  # [S, A]
    return seqs, lo, anchors
