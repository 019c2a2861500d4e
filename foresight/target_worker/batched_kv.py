"""Several requests' KV caches seen as one padded batch, for the attention of one target forward over all
their blocks.

Each request keeps its own `DynamicCache` (rollback stays a per-request crop). In a batched forward the
new tokens of every request are packed into one sequence (packed_step.py); at every attention layer
`BatchedKV` lays each request's past keys/values and its new ones side by side in one padded tensor
[B, kv_heads, columns, head_dim] for the attention, and hands each request a view of its own row as its
updated layer.

Row b of the batch feeds n_b tokens at positions T_b .. T_b + n_b - 1 (T_b = its cache length),
right-padded to the longest row (L). Its keys sit at columns [0, T_b) (past) and [T_b, T_b + L)
(new, padding included); query i attends to columns <= T_b + i, so a real query never sees padding
(real queries are i < n_b, and columns T_b + n_b.. hold only padding or stale keys). Padding queries
compute garbage that nobody reads; their keys land beyond the view each request keeps.

Steady state under load is the same requests step after step. Then the tensors of the previous step
are reused: every request's layers are still views of its row, so only the new positions are written
(in place, beyond each view's end: what a request holds is never changed). The tensors are allocated
with SPARE_COLUMNS of room; a new batch composition, or a row outgrowing the room, lays them out anew
(one copy of every request's past).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..models.slot_kv import SlotLayer

SPARE_COLUMNS = 64  # room for the next steps' positions before the batch is laid out again


def batchable(cache: DynamicCache) -> bool:
    """Only full-attention layers can be laid side by side this way (sliding-window and linear-attention
    layers keep state that is not a plain list of positions)."""
    return all(type(layer) in (DynamicLayer, SlotLayer) for layer in cache.layers)


class BatchedKV:
    """The padded keys/values of `caches` (one per row) in one batched forward, feeding `lengths[b]` real
    tokens per row, padded to `width` new positions; row b's new tokens sit at `offsets[b]` of the
    forward's packed sequence. `previous`: the last step's, whose tensors are reused when the same
    requests step again and fit."""

    def __init__(self, caches: list[DynamicCache], lengths: list[int], width: int, offsets: list[int],
                 previous: "BatchedKV | None" = None):
        self.caches = caches
        self.lengths = lengths
        self.offsets = offsets
        self.width = width  # L: new positions per row, padding included
        self.past = [c.get_seq_length() for c in caches]  # T_b
        self.columns = max(self.past) + width  # W: key columns the attention sees
        if previous is not None and previous.continues_with(caches, self.columns):
            self.tensors = previous.tensors  # per layer: (keys, values) [B, kv_heads, capacity, head_dim]
            self.capacity = previous.capacity
        else:
            self.tensors = [None] * len(caches[0].layers)
            self.capacity = self.columns + SPARE_COLUMNS
        self.reused = self.tensors[0] is not None

    def continues_with(self, caches: list[DynamicCache], columns: int) -> bool:
        """Whether `caches` are this batch's rows, in order, each layer still a view of its row, with room."""
        if len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches)):
            return False
        if self.tensors[0] is None or columns > self.capacity:
            return False
        return all(layer.keys.data_ptr() == keys[b].data_ptr() and layer.values.data_ptr() == values[b].data_ptr()
                   for b, cache in enumerate(caches) for layer, (keys, values) in zip(cache.layers, self.tensors))

    def position_ids(self, device) -> torch.Tensor:
        """[B, L] the absolute position of every fed token (padding continues the count)."""
        past = torch.tensor(self.past, device=device)[:, None]  # [B, 1]
        return past + torch.arange(self.width, device=device)[None, :]

    def attention_mask(self, device) -> torch.Tensor:
        """[B, 1, L, W] bool, True = attend: query i of row b sees key columns <= T_b + i."""
        cols = torch.arange(self.columns, device=device)[None, None, :]  # [1, 1, W]
        return (cols <= self.position_ids(device)[:, :, None])[:, None]  # [B, 1, L, W]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """key/value_states [1, kv_heads, N, head_dim]: the forward's new positions at `layer_idx`, packed.
        Columns past a row's real tokens keep whatever finite values they held: only padding queries see them."""
        if self.tensors[layer_idx] is None:
            self.tensors[layer_idx] = self._lay_out(key_states, value_states, layer_idx)
        keys, values = self.tensors[layer_idx]  # [B, kv_heads, capacity, head_dim]
        for b in range(len(self.caches)):
            past, start, n = self.past[b], self.offsets[b], self.lengths[b]
            keys[b, :, past:past + n] = key_states[0, :, start:start + n]
            values[b, :, past:past + n] = value_states[0, :, start:start + n]
        self._hold_layer(layer_idx)
        return keys[:, :, :self.columns], values[:, :, :self.columns]  # [B, kv_heads, W, head_dim]

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [B, kv_heads, capacity, head_dim], every row's past in columns [0, T_b), for
        a forward that writes its new positions itself (a compiled batched step); `hold` after it."""
        for layer_idx, tensors in enumerate(self.tensors):
            if tensors is None:
                like = next(cache.layers[layer_idx] for cache, past in zip(self.caches, self.past) if past)
                self.tensors[layer_idx] = self._lay_out(like.keys, like.values, layer_idx)
        return self.tensors

    def hold(self) -> None:
        """Every request's layers now hold its past and its new real tokens (views of its row)."""
        for layer_idx in range(len(self.tensors)):
            self._hold_layer(layer_idx)

    def _hold_layer(self, layer_idx: int) -> None:
        keys, values = self.tensors[layer_idx]
        for b, cache in enumerate(self.caches):
            end = self.past[b] + self.lengths[b]
            layer = cache.layers[layer_idx]
            layer.keys, layer.values = keys[b:b + 1, :, :end], values[b:b + 1, :, :end]  # [1, kv_heads, T_b + n_b, d]

    def _lay_out(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """New tensors (heads, head dim and dtype as `*_states` [*, kv_heads, *, head_dim]) holding every row's
        past; zeros elsewhere (masked columns meet zero attention weights, so they must hold finite numbers)."""
        _, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(len(self.caches), heads, self.capacity, dim)
        values = value_states.new_zeros(len(self.caches), heads, self.capacity, dim)
        for b, cache in enumerate(self.caches):
            if self.past[b]:
                layer = cache.layers[layer_idx]
                keys[b, :, :self.past[b]] = layer.keys[0]
                values[b, :, :self.past[b]] = layer.values[0]
        return keys, values
