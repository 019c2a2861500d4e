"""One target forward over several requests' new tokens: verify blocks and a prompt chunk, packed.

The step's new tokens are packed into one sequence [1, N] (N = the sum of the rows' lengths, no padding),
so the model's linear layers run on real tokens only. Attention is the one part where requests must not
see each other: for the forward's duration the model's attention implementation is switched to
`packed_sdpa`, which receives this `PackedStep` through the forward's keyword arguments and runs
- the short rows (verify blocks) together: their queries gathered into a padded [B, heads, L, head_dim]
  batch over `BatchedKV`'s padded keys, one SDPA call per layer;
- each long row (a prompt chunk) alone, over its own cache: padding it with the short rows would make every
  row as long as the chunk.
The outputs are scattered back to the packed order. `PackedStep` is also the forward's `cache`: its
`update` appends each row's new keys/values to that row's own cache (through `BatchedKV` for the short rows).
Every attention call, packed or not, goes through `attention`: SDPA, or for a few query positions on a CPU
the faster `folded_attention` (small_attention.py); TargetRunner runs all its forwards
with `packed_attention`, so single-request steps take that path too.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .batched_kv import BatchedKV
from .small_attention import folded_attention, takes_folded_path

PACKED_ATTENTION = "foresight_packed_sdpa"
PACKS_OVER = "sdpa"  # the attention implementation `packed_sdpa` reproduces (and runs when not packing)


def attention(module, query, key, value, attention_mask, **kwargs):
    """The model's SDPA attention, or `folded_attention` where that is faster (small_attention.py)."""
    if takes_folded_path(query, attention_mask, kwargs):
        return folded_attention(module, query, key, value, attention_mask, **kwargs)
    return AttentionInterface._global_mapping[PACKS_OVER](module, query, key, value, attention_mask, **kwargs)


def packed_sdpa(module, query, key, value, attention_mask, packed_step: "PackedStep | None" = None, **kwargs):
    """`attention`, or, inside a packed forward, `packed_step`'s per-row attention (which calls it per group)."""
    if packed_step is None:
        return attention(module, query, key, value, attention_mask, **kwargs)
    return packed_step.attend(module, query, attention, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


@contextmanager
def packed_attention(config):
    """The model's attention runs `packed_sdpa` inside the block (and what it ran before, after it)."""
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class PackedStep:
    """The `cache` (and, as `packed_step`, the attention) of one forward feeding `lengths[b]` new tokens to
    `caches[b]`, packed in row order. Rows flagged `alone` attend on their own; the others share a padded
    batch. `previous`: the last step's padded layout, reused when the same short rows step again."""

    def __init__(self, caches: list[DynamicCache], lengths: list[int], alone: list[bool],
                 previous: BatchedKV | None, device):
        self.caches = caches
        self.lengths = lengths
        self.offsets = [sum(lengths[:b]) for b in range(len(lengths))]
        self.past = [cache.get_seq_length() for cache in caches]
        self.alone = [b for b, a in enumerate(alone) if a]
        grouped = [b for b, a in enumerate(alone) if not a]
        self.batch = None
        if grouped:
            self.batch = BatchedKV([caches[b] for b in grouped], [lengths[b] for b in grouped],
                                   max(lengths[b] for b in grouped), [self.offsets[b] for b in grouped], previous)
            self._index_batch(grouped, device)
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # this layer's keys/values per alone row
        self.padded_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, kv_heads, W, head_dim] each

    def _index_batch(self, grouped: list[int], device) -> None:
        """Where the padded batch's slots come from in the packed sequence, and where its real slots go
        (None: rows of one length, first in the packed order, are the padded batch as they are)."""
        width = self.batch.width
        self.mask = self.batch.attention_mask(device)  # [B, 1, L, W]
        self.slots = self.real = self.targets = None
        if grouped == list(range(len(grouped))) and all(self.lengths[b] == width for b in grouped):
            return
        slots, real, targets = [], [], []
        for row, b in enumerate(grouped):
            start, n = self.offsets[b], self.lengths[b]
            slots += [start + min(i, n - 1) for i in range(width)]  # padding repeats the row's last token
            real += [row * width + i for i in range(n)]
            targets += range(start, start + n)
        self.slots = torch.tensor(slots, device=device)  # [B * L] packed index of every padded slot
        self.real = torch.tensor(real, device=device)  # [n_grouped] padded slots that hold real tokens
        self.targets = torch.tensor(targets, device=device)  # [n_grouped] their packed positions

    def position_ids(self, device) -> torch.Tensor:
        """[1, N] the absolute position of every packed token."""
        return torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(self.past, self.lengths)])[None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [1, kv_heads, N, head_dim]: every row's new positions at `layer_idx`. Each row's
        cache takes its own; the attention reads them from here (`attend`)."""
        if self.batch is not None:
            self.padded_kv = self.batch.update(key_states, value_states, layer_idx)
        self.layer_kv = []
        for b in self.alone:
            start, n = self.offsets[b], self.lengths[b]
            self.layer_kv.append(self.caches[b].layers[layer_idx].update(
                key_states[:, :, start:start + n], value_states[:, :, start:start + n]))
        return key_states, value_states

    def attend(self, module, query: torch.Tensor, attend_rows, **kwargs) -> tuple[torch.Tensor, None]:
        """query [1, heads, N, head_dim] -> ([1, N, heads, head_dim], None), each row over its own keys."""
        _, heads, total, dim = query.shape
        out = query.new_empty(total, heads, dim)
        if self.batch is not None:
            batch, width = len(self.batch.caches), self.batch.width
            gathered = query[0, :, :batch * width] if self.slots is None else query[0].index_select(1, self.slots)
            padded = gathered.view(heads, batch, width, dim).transpose(0, 1)  # [B, heads, L, head_dim]
            keys, values = self.padded_kv
            attended = attend_rows(module, padded, keys, values, self.mask, **kwargs)[0]  # [B, L, heads, head_dim]
            if self.slots is None:
                out[:batch * width] = attended.reshape(batch * width, heads, dim)
            else:
                out[self.targets] = attended.reshape(batch * width, heads, dim)[self.real]
        for b, (keys, values) in zip(self.alone, self.layer_kv):
            start, n, past = self.offsets[b], self.lengths[b], self.past[b]
            cols = torch.arange(past + n, device=query.device)  # [T + n]
            mask = cols[None, :] <= (past + torch.arange(n, device=query.device))[:, None]  # [n, T + n]
            attended = attend_rows(module, query[:, :, start:start + n], keys, values, mask[None, None], **kwargs)[0]
            out[start:start + n] = attended[0]  # [n, heads, head_dim]
        return out[None], None

    def snapshot(self) -> list[list[dict]]:
        """Every row's layers as they were before the forward (DynamicLayer never rewrites what it holds)."""
        return [[dict(vars(layer)) for layer in cache.layers] for cache in self.caches]

    def restore(self, snap: list[list[dict]]) -> None:
        for cache, layers in zip(self.caches, snap):
            for layer, saved in zip(cache.layers, layers):
                vars(layer).clear()
                vars(layer).update(saved)
