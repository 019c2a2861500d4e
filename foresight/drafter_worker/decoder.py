"""The training-free decoder of foresight drafting (JetSpec++ section 4.2, appendix B.1).

The decoder is the target's own top: its last `n` decoder layers, its final norm and its LM head,
frozen and shared with the target (no copies). With L target layers the decoder runs layers
L-n .. L-1, so its input is hidden_states index L-n (index i = output of layer i-1, index 0 = the
embeddings), i.e. the input of layer L-n. The adapter must predict at most this deep.

    context   the target sends its TRUE states at index L-n for every committed position;
              `extend_context` runs the top layers over them once and keeps their keys/values.
    block     `score` runs the top layers causally over the (predicted) states of the block under
              verification, positions n..n+gamma = [anchor y0, d_1..d_gamma], attending to the
              context keys/values; row j is  p_hat(. | j) = softmax(LM head(norm(h_j)))  at
              temperature 1 (appendix B.1), an estimate of the target's next-token distribution
              after d_1..d_j. The context cache is never changed by `score` (it works on a view).

With the true states of the block as input the decoder reproduces the target's logits: it is then
the "perfect decoder" of JetSpec++ Proposition 1 (tests/unit/test_decoder.py).

Only attention layers that see the whole context are supported (Llama, SmolLM2, Qwen3). Sliding-
window layers and linear-attention (Gated DeltaNet) layers need other state (a windowed cache, the
committed recurrent/conv states) and raise NotImplementedError rather than decode wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderCache", "ForesightDecoder"]

# Decoder layers with the Llama call signature, RoPE from `model.model.rotary_emb`, and a plain
# `lm_head(norm(h))` (no logit soft-capping or scaling).
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


@dataclass(slots=True)
class DecoderCache:
    """Keys/values of the decoder's layers over the verified context of one request (positions 0..length-1)."""

    kv: DynamicCache
    first_layer: int  # index of the decoder's first target layer (the layer whose cache we read)

    @property
    def length(self) -> int:
        """Number of context positions held."""
        return self.kv.layers[self.first_layer].get_seq_length()


class ForesightDecoder:
    """The target's last `n_layers` layers + final norm + LM head, frozen and shared with `model`."""

    def __init__(self, model, n_layers: int):
        config = model.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"foresight decoder supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r} "
                "(sliding-window, linear-attention and soft-capped models need their own decoder)"
            )
        n_total = config.num_hidden_layers
        if not 1 <= n_layers <= n_total:
            raise ValueError(f"n_layers must lie in [1, {n_total}], got {n_layers}")
        self.first_layer = n_total - n_layers
        self.layer_ids = list(range(self.first_layer, n_total))
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n_total
        unsupported = {i: layer_types[i] for i in self.layer_ids if layer_types[i] != "full_attention"}
        if unsupported:
            raise NotImplementedError(
                f"foresight decoder supports only full-attention layers; layers {unsupported} are not "
                "(sliding-window / linear-attention state is not implemented)"
            )
        self.model = model
        self.config = config
        self.layers = [model.model.layers[i] for i in self.layer_ids]  # shared, not copied
        self.norm = model.model.norm
        self.rotary_emb = model.model.rotary_emb
        self.lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def input_index(self) -> int:
        """hidden_states index the decoder reads (= L - n_layers): output of layer L-n-1, input of layer L-n."""
        return self.first_layer

    def new_cache(self) -> DecoderCache:
        return DecoderCache(kv=DynamicCache(config=self.config), first_layer=self.first_layer)

    # -- context ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def extend_context(self, cache: DecoderCache, states: torch.Tensor, start_pos: int) -> None:
        """Append the TRUE states [n_new, hidden] (index `input_index`) of positions start_pos.. .

        `start_pos` may lie before the end of the context (the positions from there on are replaced,
        e.g. after a rollback) but not after it: the context must stay contiguous from position 0.
        """
        length = cache.length
        if not 0 <= start_pos <= length:
            raise ValueError(f"context holds positions 0..{length - 1}; cannot extend at {start_pos}")
        if start_pos < length:
            cache.kv.crop(start_pos - length)  # negative count: drop the replaced tail
        if states.shape[0] == 0:
            return
        self._layers(states, start_pos, cache.kv)  # fills cache.kv for the decoder layers

    # -- block ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def logits(self, cache: DecoderCache, block_states: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """LM-head logits over the block, float32.

        block_states  [gamma+1, hidden] or [batch, gamma+1, hidden]: states at `input_index` of
                      positions start_pos..start_pos+gamma (anchor, d_1..d_gamma); each batch row is
                      an independent block over the same context.
        start_pos     the anchor's position (default: the context length). A smaller value attends
                      to the context before it only.
        returns       [gamma+1, vocab] (or [batch, gamma+1, vocab]); row j = logits after d_1..d_j.
        """
        return self.logits_and_hidden(cache, block_states, start_pos)[0]

    @torch.inference_mode()
    def logits_and_hidden(self, cache: DecoderCache, block_states: torch.Tensor,
                          start_pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` plus the final-normed states it read them from (hidden_states index L, in the
        decoder's dtype): [(batch,) gamma+1, vocab] float32 and [(batch,) gamma+1, hidden]."""
        length = cache.length
        start_pos = length if start_pos is None else start_pos
        if not 0 <= start_pos <= length:
            raise ValueError(f"block must start within the context 0..{length}, got {start_pos}")
        squeeze = block_states.dim() == 2
        blocks = block_states[None] if squeeze else block_states  # [batch, gamma+1, hidden]
        view = self._view(cache, upto=start_pos, batch=blocks.shape[0])  # context KV; cache untouched
        h = self.norm(self._layers(blocks, start_pos, view))  # [batch, gamma+1, hidden]
        out = self.lm_head(h).float()  # [batch, gamma+1, vocab]
        return (out[0], h[0]) if squeeze else (out, h)

    def score(self, cache: DecoderCache, block_states: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """p_hat(. | j) for every prefix j of the block: softmax of `logits` at temperature 1.

        [gamma+1, hidden] -> float32 probabilities [gamma+1, vocab] (batched: [batch, gamma+1, vocab]).
        """
        return torch.softmax(self.logits(cache, block_states, start_pos), dim=-1)

    # -- internals --------------------------------------------------------------------------------

    def _view(self, cache: DecoderCache, upto: int, batch: int) -> DynamicCache:
        """A fresh cache whose decoder layers hold (references to) the first `upto` context positions."""
        view = DynamicCache(config=self.config)
        if upto == 0:
            return view
        for i in self.layer_ids:
            src, dst = cache.kv.layers[i], view.layers[i]
            keys = src.keys[:, :, :upto].expand(batch, -1, -1, -1)  # [batch, kv_heads, upto, head_dim]
            values = src.values[:, :, :upto].expand(batch, -1, -1, -1)
            dst.lazy_initialization(keys, values)
            dst.keys, dst.values = keys, values  # DynamicLayer.update concatenates: never written in place
        return view

    def _layers(self, states: torch.Tensor, start_pos: int, kv: DynamicCache) -> torch.Tensor:
        """Top layers over `states` [(batch,) T, hidden] at positions start_pos.. -> [batch, T, hidden].

        Explicit position_ids, and the mask sized from the decoder's first layer (`layer_idx`): layer 0
        holds no keys here, and the default would size the mask from it (TRANSFORMERS-NOTES section 3).
        """
        h = states.to(device=self.device, dtype=self.dtype)
        if h.dim() == 2:
            h = h[None]  # [1, T, hidden]
        batch, n_pos, _ = h.shape
        position_ids = torch.arange(start_pos, start_pos + n_pos, device=self.device).expand(batch, -1)  # [batch, T]
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)  # (cos, sin) [batch, T, head_dim]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=kv,
            position_ids=position_ids, layer_idx=self.first_layer,
        )
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, cache=kv, use_cache=True,
                      position_embeddings=position_embeddings)
        return h
