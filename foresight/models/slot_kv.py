"""KV cache layers that append in place: the static buffers compiled forwards write into.

A `SlotLayer` is transformers' `DynamicLayer` whose keys/values are views [batch, kv_heads, T, head_dim] of
buffers with room for more positions: a forward writes its new positions after the view's end and the view
grows; a rollback is `crop`, which shortens the view, and the next forward overwrites the rejected positions.
What a layer holds is never rewritten, so references to its views stay valid snapshots (as with DynamicLayer).
The buffers grow a page at a time (one copy of the past), and a layer whose views were handed to another
tensor (a batched step lays every request out in one, target_worker/batched_kv.py; the foresight decoder's pass of
several requests) moves back into buffers of its own at its next compiled step. The target's compiled steps and the
foresight decoder's compiled pass keep their KV in them (models/compiled_step.py, models/compiled_decoder.py).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

PAGE = 256  # buffer capacity is a multiple of this many positions


class SlotLayer(DynamicLayer):
    """A full-attention layer whose positions live in buffers with room (`room`)."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [batch, kv_heads, capacity, head_dim] each

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [batch, kv_heads, n, head_dim] -> the layer's keys/values, past and new."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.get_seq_length()
        end = past + key_states.shape[-2]
        keys, values = self.room(end, key_states, value_states)
        keys[:, :, past:end] = key_states
        values[:, :, past:end] = value_states
        self.hold(end)
        return self.keys, self.values

    def room(self, end: int, key_like: torch.Tensor | None = None,
             value_like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's buffers, holding its past in columns [0, T) and room for `end` columns (`*_like`: the
        shape and dtype of new buffers when the layer holds nothing yet; an uninitialized layer takes its dtype and
        device from them)."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        past = self.get_seq_length()
        if self.buffers is not None:
            keys, values = self.buffers
            if past == 0 or (keys.data_ptr() == self.keys.data_ptr() and values.data_ptr() == self.values.data_ptr()):
                if keys.shape[2] >= end:
                    return self.buffers
        key_like = self.keys if past else key_like
        value_like = self.values if past else value_like
        capacity = -(-end // PAGE) * PAGE
        keys = key_like.new_zeros(key_like.shape[0], key_like.shape[1], capacity, key_like.shape[3])
        values = value_like.new_zeros(value_like.shape[0], value_like.shape[1], capacity, value_like.shape[3])
        if past:
            keys[:, :, :past] = self.keys
            values[:, :, :past] = self.values
        self.buffers = (keys, values)
        return self.buffers

    def hold(self, end: int) -> None:
        """The layer now holds the first `end` columns of its buffers."""
        keys, values = self.buffers
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]


def no_keys(config, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty keys and values [1, kv_heads, 0, head_dim] of a model with `config`: what an uninitialized
    `SlotLayer`'s first buffers are shaped after (`room`)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    empty = torch.empty(1, config.num_key_value_heads, 0, dim, dtype=dtype, device=device)
    return empty, empty


def slot_cache(cache: DynamicCache) -> DynamicCache:
    """`cache` with its plain full-attention layers made `SlotLayer`s (others, sliding or linear, stay)."""
    cache.layers = [SlotLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
