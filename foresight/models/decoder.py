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

Hybrid targets (Qwen3.5, Qwen3-Next: Gated DeltaNet layers between full-attention ones). A linear-
attention layer has no keys/values to attend to: its context is its committed recurrent + conv state,
the state after positions 0..length-1. The cache keeps that state (batch 1); `extend_context` advances it
over the new TRUE states, and every block row starts from a copy of it. The target sends the same state
after each verification (protocol `LinearStates`, `position` = the positions it covers): a snapshot whose
position is the context length after an extension replaces the decoder's own (`adopt`), one with another
position is stale and ignored. A snapshot is what lets `logits_and_hidden` take new context states and a
block in ONE pass: that pass runs the linear layers on past the context into the block, and the state
after the context alone, which the pass cannot give, is the target's snapshot. Without one it takes two
passes. Linear-attention state cannot be rolled back, so a hybrid context only grows.

Supported: full-attention layers that see the whole context (Llama, SmolLM2, Qwen3, and the gated
attention of Qwen3.5 / Qwen3-Next), and the Gated DeltaNet layers of Qwen3.5 / Qwen3-Next. Sliding-
window layers (Gemma3) would need a windowed cache and soft-capped heads their own head; both raise
NotImplementedError rather than decode wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from ..protocol.messages import LinearStates

__all__ = ["SUPPORTED_MODEL_TYPES", "HYBRID_MODEL_TYPES", "DecoderCache", "ForesightDecoder"]

# Decoder layers with the Llama call signature, RoPE from `model.model.rotary_emb`, and a plain
# `lm_head(norm(h))` (no logit soft-capping or scaling).
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
# The same call signature and head, with Gated DeltaNet layers between the full-attention ones.
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")


@dataclass(slots=True)
class DecoderCache:
    """The decoder's layers' context of one request, positions 0..length-1: keys/values of its attention
    layers, the committed state of its linear-attention layers (both in `kv`)."""

    kv: DynamicCache
    first_layer: int  # index of the decoder's first target layer
    length: int = 0  # context positions held
    adopted: int = 0  # target snapshots taken in place of the decoder's own linear state (see `adopt`)
    stale: int = 0  # snapshots offered at another position than the context's, ignored


class ForesightDecoder:
    """The target's last `n_layers` layers + final norm + LM head, frozen and shared with `model`."""

    def __init__(self, model, n_layers: int, vocab_subset: torch.Tensor | None = None):
        """`vocab_subset`: token ids [V'] the LM head scores (the rest get probability 0). The head is the
        largest weight the decoder reads and reading it dominates a few-row pass where memory bandwidth
        bounds (CPU, GPU decode); the draft model's own subset loses no outcome whose draft it can make."""
        config = model.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES:
            raise NotImplementedError(
                f"foresight decoder supports model types {SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES}, got "
                f"{model_type!r} (sliding-window and soft-capped models need their own decoder)"
            )
        n_total = config.num_hidden_layers
        if not 1 <= n_layers <= n_total:
            raise ValueError(f"n_layers must lie in [1, {n_total}], got {n_layers}")
        self.first_layer = n_total - n_layers
        self.layer_ids = list(range(self.first_layer, n_total))
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n_total
        known = ("full_attention", "linear_attention") if model_type in HYBRID_MODEL_TYPES else ("full_attention",)
        unsupported = {i: layer_types[i] for i in self.layer_ids if layer_types[i] not in known}
        if unsupported:
            raise NotImplementedError(
                f"foresight decoder supports {known} layers; layers {unsupported} are not "
                "(sliding-window state is not implemented)"
            )
        # Linear-attention layers the decoder runs: the target sends their committed state (`state_layers`).
        self.linear_layers = [i for i in self.layer_ids if layer_types[i] == "linear_attention"]
        self.attention_layers = [i for i in self.layer_ids if layer_types[i] == "full_attention"]
        self.model = model
        self.config = config
        self.layers = [model.model.layers[i] for i in self.layer_ids]  # shared, not copied
        self.norm = model.model.norm
        self.rotary_emb = model.model.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.vocab_subset = None if vocab_subset is None else vocab_subset.long().to(self.lm_head.weight.device)
        # [V', hidden] copy of the subset's rows (a gather per call would read the whole head again)
        self._head_rows = None if vocab_subset is None else self.lm_head.weight.detach()[self.vocab_subset].clone()
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
    def extend_context(self, cache: DecoderCache, states: torch.Tensor, start_pos: int,
                       linear_states: LinearStates | None = None) -> None:
        """Append the TRUE states [n_new, hidden] (index `input_index`) of positions start_pos.. .

        `start_pos` may lie before the end of the context (the positions from there on are replaced,
        e.g. after a rollback; not with linear-attention layers) but not after it: the context must stay
        contiguous from position 0. `linear_states`: the target's snapshot, adopted if it covers exactly
        the extended context.
        """
        length = cache.length
        if not 0 <= start_pos <= length:
            raise ValueError(f"context holds positions 0..{length - 1}; cannot extend at {start_pos}")
        if start_pos < length:
            if self.linear_layers:
                raise ValueError(f"linear-attention state cannot be rolled back (context {length}, "
                                 f"extend at {start_pos})")
            cache.kv.crop(start_pos - length)  # negative count: drop the replaced tail
        if states.shape[0]:
            self._layers(states, start_pos, cache.kv)  # fills cache.kv for the decoder layers
        cache.length = start_pos + states.shape[0]
        self.adopt(cache, linear_states)

    @torch.inference_mode()
    def adopt(self, cache: DecoderCache, linear_states: LinearStates | None) -> bool:
        """Take the target's committed state of the linear layers if it covers exactly positions
        0..length-1 of the context; a snapshot of another position is stale and ignored."""
        if linear_states is None or not self.linear_layers:
            return False
        if linear_states.position != cache.length:
            cache.stale += 1
            return False
        missing = [i for i in self.linear_layers if i not in linear_states.layers]
        if missing:
            raise ValueError(f"the target's snapshot holds layers {linear_states.layers}, the decoder needs {missing}")
        for i in self.linear_layers:
            j = linear_states.layers.index(i)
            _set_linear_state(cache.kv.layers[i], linear_states.conv[j][None], linear_states.recurrent[j][None])
        cache.adopted += 1
        return True

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
    def logits_and_hidden(self, cache: DecoderCache, block_states: torch.Tensor, start_pos: int | None = None,
                          keep: tuple[int, ...] = (), context_states: torch.Tensor | None = None,
                          linear_states: LinearStates | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` plus states the decoder passes through (in the decoder's dtype): the raw states at the
        hidden_states indices `keep` (each in (input_index, L)), then the final-normed state (index L).
        -> [(batch,) gamma+1, vocab] float32 and [(batch,) gamma+1, (len(keep)+1) * hidden].

        `context_states` [m, hidden]: TRUE states of the m positions after the context, appended to it
        (as `extend_context`) in the same pass as one block (batch 1) that starts right after them. A
        pass over a few rows costs what reading the layers' weights costs, so this halves a round's
        decoder time against extending and scoring separately. With linear-attention layers the one pass
        needs `linear_states`, the target's snapshot after those m positions; without it, two passes."""
        bad = [i for i in keep if not self.input_index < i < self.layer_ids[-1] + 1]
        if bad:
            raise ValueError(f"the decoder passes through indices {self.input_index + 1}..{self.layer_ids[-1]}, "
                             f"not {bad}")
        squeeze = block_states.dim() == 2
        blocks = block_states[None] if squeeze else block_states  # [batch, gamma+1, hidden]
        kept: list[torch.Tensor] = []
        if context_states is not None and context_states.shape[0] and self.linear_layers and not (
                linear_states is not None and linear_states.position == cache.length + context_states.shape[0]):
            # No snapshot to end a one-pass extension at: extend first, then score the block.
            self.extend_context(cache, context_states, cache.length, linear_states)
            context_states = None
        if context_states is not None and context_states.shape[0]:
            h = self._extend_and_run(cache, context_states, blocks, start_pos, keep, kept, linear_states)
        else:
            length = cache.length
            start_pos = length if start_pos is None else start_pos
            if not 0 <= start_pos <= length:
                raise ValueError(f"block must start within the context 0..{length}, got {start_pos}")
            view = self._view(cache, upto=start_pos, batch=blocks.shape[0])  # context KV; cache untouched
            h = self._layers(blocks, start_pos, view, keep, kept)
        h = self.norm(h)  # [batch, gamma+1, hidden]
        out = self._head(h)  # [batch, gamma+1, vocab] float32
        states = torch.cat([*kept, h], dim=-1)  # [batch, gamma+1, (len(keep)+1) * hidden]
        return (out[0], states[0]) if squeeze else (out, states)

    def _extend_and_run(self, cache: DecoderCache, context_states: torch.Tensor, blocks: torch.Tensor,
                        start_pos: int | None, keep: tuple[int, ...], kept: list[torch.Tensor],
                        linear_states: LinearStates | None) -> torch.Tensor:
        """One pass over [new context states; block] -> the block's top-layer states [1, gamma+1, hidden];
        the cache keeps the new context positions' keys/values only, and the snapshot's linear state."""
        length, m = cache.length, context_states.shape[0]
        if blocks.shape[0] != 1 or (start_pos is not None and start_pos != length + m):
            raise ValueError(f"context_states go with one block starting right after them (position {length + m})")
        both = torch.cat([context_states.to(blocks.dtype), blocks[0]])[None]  # [1, m + gamma+1, hidden]
        rows: list[torch.Tensor] = []
        h = self._layers(both, length, cache.kv, keep, rows)
        for i in self.attention_layers:
            cache.kv.layers[i].crop(-blocks.shape[1])  # the block's keys/values were scratch
        cache.length = length + m
        self.adopt(cache, linear_states)  # the linear layers ran on into the block: the state after m is the target's
        kept.extend(r[:, m:] for r in rows)
        return h[:, m:]

    def score(self, cache: DecoderCache, block_states: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """p_hat(. | j) for every prefix j of the block: softmax of `logits` at temperature 1.

        [gamma+1, hidden] -> float32 probabilities [gamma+1, vocab] (batched: [batch, gamma+1, vocab]).
        """
        return torch.softmax(self.logits(cache, block_states, start_pos), dim=-1)

    # -- internals --------------------------------------------------------------------------------

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over normed states [..., hidden] -> float32 logits [..., vocab] (-inf outside the subset)."""
        if self._head_rows is None:
            return self.lm_head(h).float()
        sub = torch.nn.functional.linear(h, self._head_rows).float()  # [..., V']
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.vocab_subset] = sub
        return out

    def _view(self, cache: DecoderCache, upto: int, batch: int) -> DynamicCache:
        """A fresh cache whose decoder layers hold (references to) the first `upto` context positions."""
        view = DynamicCache(config=self.config)
        if upto == 0:
            return view
        if self.linear_layers and upto != cache.length:
            raise ValueError(f"linear-attention state is held only at the context's end ({cache.length}), "
                             f"not at {upto}")
        for i in self.linear_layers:  # each row starts from its own copy: the layers update it in place
            src = cache.kv.layers[i]
            _set_linear_state(view.layers[i], src.conv_states[0].expand(batch, -1, -1),
                              src.recurrent_states[0].expand(batch, -1, -1, -1))
        for i in self.attention_layers:
            src, dst = cache.kv.layers[i], view.layers[i]
            keys = src.keys[:, :, :upto].expand(batch, -1, -1, -1)  # [batch, kv_heads, upto, head_dim]
            values = src.values[:, :, :upto].expand(batch, -1, -1, -1)
            dst.lazy_initialization(keys, values)
            dst.keys, dst.values = keys, values  # DynamicLayer.update concatenates: never written in place
        return view

    def _layers(self, states: torch.Tensor, start_pos: int, kv: DynamicCache, keep: tuple[int, ...] = (),
                kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Top layers over `states` [(batch,) T, hidden] at positions start_pos.. -> [batch, T, hidden];
        the states at hidden_states indices `keep` are appended to `kept` in `keep` order.

        Explicit position_ids, and the mask sized from the decoder's first attention layer (`layer_idx`):
        layer 0 holds no keys here, and the default would size the mask from it.
        """
        h = states.to(device=self.device, dtype=self.dtype)
        if h.dim() == 2:
            h = h[None]  # [1, T, hidden]
        batch, n_pos, _ = h.shape
        position_ids = torch.arange(start_pos, start_pos + n_pos, device=self.device).expand(batch, -1)  # [batch, T]
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)  # (cos, sin) [batch, T, head_dim]
        mask = None if not self.attention_layers else create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=kv,
            position_ids=position_ids, layer_idx=self.attention_layers[0],
        )
        seen: dict[int, torch.Tensor] = {}
        for layer_id, layer in zip(self.layer_ids, self.layers):
            # Linear-attention layers take no mask (no padding here): their context is their state.
            layer_mask = None if layer_id in self.linear_layers else mask
            h = layer(h, attention_mask=layer_mask, position_ids=position_ids, cache=kv, use_cache=True,
                      position_embeddings=position_embeddings)
            if layer_id + 1 in keep:  # index i = output of layer i-1
                seen[layer_id + 1] = h
        if kept is not None:
            kept.extend(seen[i] for i in keep)
        return h


def _set_linear_state(layer, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Give a LinearAttentionLayer of a DynamicCache the state conv [B, conv_dim, kernel] and recurrent
    [B, v_heads, k_dim, v_dim] (copied: the layer updates its tensors in place)."""
    if not layer.is_conv_states_initialized[0]:
        layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent)
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(recurrent)
    layer.has_previous_state[0] = True  # the next forward continues from it (not a prefill from zeros)
