"""Several requests' KV caches seen as one padded batch, for one target forward over all their blocks.

Each request keeps its own `DynamicCache` (rollback stays a per-request crop). For a batched forward,
`BatchedKV` stands in for the cache: at every attention layer it lays each request's past keys/values
and the new ones of its row side by side in one zero-padded tensor, returns that tensor to the
attention, and hands each request a view of its own row as its updated layer. So the step copies each
request's KV once per layer -- what `DynamicLayer.update`'s `torch.cat` costs a one-request step too.

Row b of the batch feeds n_b tokens at positions T_b .. T_b + n_b - 1 (T_b = its cache length),
right-padded to the longest row (L). Its keys sit at columns [0, T_b) (past) and [T_b, T_b + L)
(new, padding included); query i attends to columns <= T_b + i, so a real query never sees padding
(real queries are i < n_b, and columns T_b + n_b.. hold only padding). Padding queries compute
garbage that nobody reads; their keys land beyond the view each request keeps.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def batchable(cache: DynamicCache) -> bool:
    """Only full-attention layers can be laid side by side this way (sliding-window and linear-attention
    layers keep state that is not a plain list of positions)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


class BatchedKV:
    """The `cache` argument of one batched forward over `caches` (one per row), feeding `lengths[b]` real
    tokens per row, padded to `width` new positions."""

    def __init__(self, caches: list[DynamicCache], lengths: list[int], width: int):
        self.caches = caches
        self.lengths = lengths
        self.width = width  # L: new positions per row, padding included
        self.past = [c.get_seq_length() for c in caches]  # T_b
        self.columns = max(self.past) + width  # W: key columns of the padded batch

    def position_ids(self, device) -> torch.Tensor:
        """[B, L] the absolute position of every fed token (padding continues the count)."""
        past = torch.tensor(self.past, device=device)[:, None]  # [B, 1]
        return past + torch.arange(self.width, device=device)[None, :]

    def attention_mask(self, device) -> torch.Tensor:
        """[B, 1, L, W] bool, True = attend: query i of row b sees key columns <= T_b + i."""
        cols = torch.arange(self.columns, device=device)[None, None, :]  # [1, 1, W]
        return (cols <= self.position_ids(device)[:, :, None])[:, None]  # [B, 1, L, W]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, kv_heads, L, head_dim]: the new positions of every row at `layer_idx`."""
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(batch, heads, self.columns, dim)  # [B, kv_heads, W, head_dim]
        values = value_states.new_zeros(batch, heads, self.columns, dim)
        for b, cache in enumerate(self.caches):
            layer, past = cache.layers[layer_idx], self.past[b]
            if past:
                keys[b, :, :past] = layer.keys[0]
                values[b, :, :past] = layer.values[0]
            keys[b, :, past:past + self.width] = key_states[b]
            values[b, :, past:past + self.width] = value_states[b]
            end = past + self.lengths[b]
            layer.keys, layer.values = keys[b:b + 1, :, :end], values[b:b + 1, :, :end]  # [1, kv_heads, T_b + n_b, d]
        return keys, values

    def snapshot(self) -> list[list[tuple]]:
        """References to every request's layers before the forward (DynamicLayer never writes in place)."""
        return [[(layer.keys, layer.values) for layer in c.layers] for c in self.caches]

    def restore(self, snap: list[list[tuple]]) -> None:
        for cache, layers in zip(self.caches, snap):
            for layer, (k, v) in zip(cache.layers, layers):
                layer.keys, layer.values = k, v
