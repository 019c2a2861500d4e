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

Several requests in one pass (`logits_and_hidden_many`, the foresight drafter's batch): each row attends
to its own cache's keys/values, right-padded to the longest context under a padding mask, at its own
positions, and takes its request's new context states in the same pass; linear-attention layers start
each row from a copy of its request's committed state. `logits_and_hidden` is the one-cache case.

Compiled (models/compiled_decoder.py, `--drafter-compile`): a pass of one row after its cache's whole context (a
round's new context states and block, a context extension) runs one AOTInductor graph, the cache's attention layers
then `SlotLayer`s the graph writes into in place; every other pass stays as described here.

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
from .slot_kv import SlotLayer, slot_cache

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
        # Linear-attention layers the decoder runs: the target sends their committed state
        # (`HiddenLayout.state_layers`).
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
        param = self.norm.weight  # not the embedding: the decoder never reads it (`keep_decoder_parts`)
        self.device, self.dtype = param.device, param.dtype
        self.compiled = None  # the compiled pass over one request's row (models/compiled_decoder.py), if built

    def use_compiled(self, compiled) -> None:
        """Run single-row passes through `compiled` (a `CompiledDecoder`); caches made from now on keep their keys
        and values in place (`SlotLayer`s) for it."""
        self.compiled = compiled

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def input_index(self) -> int:
        """hidden_states index the decoder reads (= L - n_layers): output of layer L-n-1, input of layer L-n."""
        return self.first_layer

    def new_cache(self) -> DecoderCache:
        kv = DynamicCache(config=self.config)
        return DecoderCache(kv=slot_cache(kv) if self.compiled is not None else kv, first_layer=self.first_layer)

    def _compiled_takes(self, cache: DecoderCache, tokens: int, keep: tuple[int, ...] | None = None) -> bool:
        """Whether the compiled pass serves a row of `tokens` positions after `cache`'s whole context, returning
        the states at `keep` (None: none wanted, a context extension)."""
        compiled = self.compiled
        if compiled is None or not self.attention_layers:
            return False
        keep = compiled.keep if keep is None else keep
        takes = compiled.takes(tokens, keep) and isinstance(cache.kv.layers[self.attention_layers[0]], SlotLayer)
        compiled.eager_passes += not takes
        return takes

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
        if states.shape[0] and self._compiled_takes(cache, states.shape[0]):
            self.compiled.run(cache, states[None].to(self.device, self.dtype), start_pos, start_pos + states.shape[0])
        elif states.shape[0]:
            positions = torch.arange(start_pos, start_pos + states.shape[0], device=self.device)[None]  # [1, n]
            self._layers(states, positions, cache.kv)  # fills cache.kv for the decoder layers
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
        needs `linear_states`, the target's snapshot after those m positions; without it, two passes.
        (`logits_and_hidden_many` with this one cache in every row.)"""
        squeeze = block_states.dim() == 2
        blocks = block_states[None] if squeeze else block_states  # [batch, gamma+1, hidden]
        batch = blocks.shape[0]
        if context_states is not None and batch != 1:
            raise ValueError("context_states go with one block starting right after them")
        out, states = self.logits_and_hidden_many(
            [cache] * batch, blocks, None if start_pos is None else [start_pos] * batch, keep,
            None if context_states is None else [context_states], [linear_states] * batch)
        return (out[0], states[0]) if squeeze else (out, states)

    @torch.inference_mode()
    def logits_and_hidden_many(self, caches: list[DecoderCache], blocks: torch.Tensor,
                               starts: list[int | None] | None = None, keep: tuple[int, ...] = (),
                               context_states: list[torch.Tensor | None] | None = None,
                               linear_states: list[LinearStates | None] | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits_and_hidden` for several requests in one pass: row g of blocks [G, gamma+1, hidden] (a
        shorter block right-padded: it attends causally) over caches[g] at positions starts[g]..
        (None: the context's end, after its new states). A cache may stand for several rows (the rows of
        one request) but take new states in one row only.

        `context_states[g]` [m_g, hidden] (or None): TRUE states of the positions after caches[g]'s context,
        taken into it in the same pass; the row's block then starts right after them. With linear-attention
        layers that needs `linear_states[g]`, the target's snapshot after them; a row without one is
        extended on its own first (two passes for that request).

        The pass lays the rows side by side like the target's batched verify (target_worker/batched_kv.py):
        row g feeds [new states; block] at positions T_g.. (T_g = the context positions it attends to),
        right-padded to the longest; each attention layer sees the rows' context keys/values right-padded to
        the longest context, T, then the new keys, under a padding mask; linear-attention layers start each
        row from a copy of its cache's committed state. A cache takes its new states only once the pass has
        succeeded (a two-pass row's extension comes before it).
        -> logits [G, gamma+1, vocab] float32, states [G, gamma+1, (len(keep)+1) * hidden]; row g equals
        what `logits_and_hidden` gives for it alone, up to float rounding."""
        bad = [i for i in keep if not self.input_index < i < self.layer_ids[-1] + 1]
        if bad:
            raise ValueError(f"the decoder passes through indices {self.input_index + 1}..{self.layer_ids[-1]}, "
                             f"not {bad}")
        g, width = blocks.shape[:2]
        starts = list(starts) if starts is not None else [None] * g
        news = [None if c is None or not c.shape[0] else c for c in (context_states or [None] * g)]
        news += [None] * (g - len(news))
        snaps = list(linear_states) if linear_states is not None else [None] * g
        for cache, start, new in zip(caches, starts, news):
            length = cache.length
            if new is not None and sum(c is cache for c in caches) > 1:
                raise ValueError("a cache that takes new context states stands for one row only")
            if new is not None and start is not None and start != length + new.shape[0]:
                raise ValueError(f"context_states go with one block starting right after them "
                                 f"(position {length + new.shape[0]})")
            if new is None and start is not None and not 0 <= start <= length:
                raise ValueError(f"block must start within the context 0..{length}, got {start}")
        for r, (cache, new, snap) in enumerate(zip(caches, news, snaps)):
            if new is not None and self.linear_layers and not (
                    snap is not None and snap.position == cache.length + new.shape[0]):
                # No snapshot to end a one-pass extension at: extend first, then score the block.
                self.extend_context(cache, new, cache.length, snap)
                news[r] = None
        m = [0 if new is None else new.shape[0] for new in news]  # new context positions per row
        past = [cache.length if new is not None or start is None else start
                for cache, start, new in zip(caches, starts, news)]  # T_g
        if g == 1 and past[0] == caches[0].length and self._compiled_takes(caches[0], m[0] + width, keep):
            return self._compiled_row(caches[0], news[0], blocks[0])
        cols = max(m) + width  # W: positions fed per row, padding included
        x = blocks.to(device=self.device, dtype=self.dtype)
        if any(m):  # row g = [new_g; block_g; padding]
            x = x.new_zeros(g, cols, x.shape[-1])
            for r, new in enumerate(news):
                if new is not None:
                    x[r, :m[r]] = new.to(x)
                x[r, m[r]:m[r] + width] = blocks[r].to(x)
        position_ids = torch.tensor(past, device=self.device)[:, None] + torch.arange(cols, device=self.device)
        view, padding = self._view(caches, past, cols)
        rows: list[torch.Tensor] = []
        h = self._layers(x, position_ids, view, keep, rows, padding)  # [G, W, hidden]
        t = max(past)
        for r, (cache, new) in enumerate(zip(caches, news)):
            if new is not None:
                for i in self.attention_layers:  # the new positions' keys/values; the block's were scratch
                    src = view.layers[i]
                    _append(cache.kv.layers[i], src.keys, src.values, r, past[r], t, m[r], g == 1)
                cache.length += m[r]
                # The linear layers ran on into the block: the state after the new positions is the target's.
                self.adopt(cache, snaps[r])
        if any(m):
            take = lambda y: torch.stack([y[r, m[r]:m[r] + width] for r in range(g)])  # noqa: E731
            h, rows = take(h), [take(y) for y in rows]
        h = self.norm(h)  # [G, gamma+1, hidden]
        return self._head(h), torch.cat([*rows, h], dim=-1)

    def _compiled_row(self, cache: DecoderCache, new: torch.Tensor | None, block: torch.Tensor):
        """`logits_and_hidden_many` of one row after `cache`'s context through the compiled pass: new [m, hidden]
        context states (or None) taken into the cache, then the block [width, hidden] scored ->
        ([1, width, vocab] float32, [1, width, (len(keep) + 1) * hidden])."""
        m = 0 if new is None else new.shape[0]
        x = block if new is None else torch.cat([new.to(block), block])  # [m + width, hidden]
        normed, kept = self.compiled.run(cache, x[None].to(self.device, self.dtype), cache.length, cache.length + m)
        cache.length += m
        normed, kept = normed[:, m:], kept[:, m:]  # the block's rows [1, width, ...]
        return self._head(normed), torch.cat([kept, normed], dim=-1)

    def score(self, cache: DecoderCache, block_states: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """p_hat(. | j) for every prefix j of the block: softmax of `logits` at temperature 1.

        [gamma+1, hidden] -> float32 probabilities [gamma+1, vocab] (batched: [batch, gamma+1, vocab]).
        """
        return torch.softmax(self.logits(cache, block_states, start_pos), dim=-1)

    # -- internals --------------------------------------------------------------------------------

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over normed states [..., hidden] -> float32 logits [..., vocab] (-inf outside the subset).
        The product runs on a 2-D view: a slice [1, width, hidden] of a longer pass keeps that pass's batch stride,
        which sends a bf16 product down a path ~10x slower on CPUs (measured with a 2-position offset)."""
        if self._head_rows is None:
            return self.lm_head(h.reshape(-1, h.shape[-1])).float().unflatten(0, h.shape[:-1])
        sub = torch.nn.functional.linear(h.reshape(-1, h.shape[-1]), self._head_rows).float()
        sub = sub.unflatten(0, h.shape[:-1])  # [..., V']
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.vocab_subset] = sub
        return out

    def _view(self, caches: list[DecoderCache], past: list[int], cols: int):
        """A fresh cache for one pass whose row g continues caches[g] after its first past[g] positions:
        attention layers hold the rows' context keys/values [G, kv_heads, T, head_dim] (T = max(past); zeros
        past a shorter row's end), linear-attention layers a copy of each row's committed state. Rows over
        one cache share its tensors (views; `DynamicLayer.update` concatenates, never writes in place). Also
        the 2-D padding mask [G, T + cols] (True = a real key; None when no row is padded)."""
        g, t = len(caches), max(past)
        view = DynamicCache(config=self.config)
        shared = all(c is caches[0] for c in caches) and len(set(past)) == 1
        for cache, upto in zip(caches, past):
            if self.linear_layers and cache.length and upto != cache.length:
                raise ValueError(f"linear-attention state is held only at the context's end ({cache.length}), "
                                 f"not at {upto}")
        held = [c.kv.layers for c in caches if c.length]
        for i in self.linear_layers if held else ():  # each row starts from its own copy: the layers update it
            zero = [torch.zeros_like(held[0][i].conv_states[0][0]), torch.zeros_like(held[0][i].recurrent_states[0][0])]
            # A row whose cache holds no position yet starts from zeros, which the layer treats as no past.
            conv = torch.stack([c.kv.layers[i].conv_states[0][0] if c.length else zero[0] for c in caches])
            rec = torch.stack([c.kv.layers[i].recurrent_states[0][0] if c.length else zero[1] for c in caches])
            _set_linear_state(view.layers[i], conv, rec)  # [G, conv_dim, kernel], [G, v_heads, k_dim, v_dim]
        if t == 0:
            return view, None
        for i in self.attention_layers:
            dst = view.layers[i]
            if shared:
                keys = caches[0].kv.layers[i].keys[:, :, :t].expand(g, -1, -1, -1)  # [G, kv_heads, T, head_dim]
                values = caches[0].kv.layers[i].values[:, :, :t].expand(g, -1, -1, -1)
            else:
                first = next(c.kv.layers[i] for c, n in zip(caches, past) if n)
                keys = first.keys.new_zeros(g, first.keys.shape[1], t, first.keys.shape[-1])
                values = first.values.new_zeros(g, first.values.shape[1], t, first.values.shape[-1])
                for r, (cache, n) in enumerate(zip(caches, past)):
                    if n:
                        keys[r, :, :n] = cache.kv.layers[i].keys[0, :, :n]
                        values[r, :, :n] = cache.kv.layers[i].values[0, :, :n]
            dst.lazy_initialization(keys, values)
            dst.keys, dst.values = keys, values
        if len(set(past)) == 1:
            return view, None
        real = torch.arange(t, device=self.device) < torch.tensor(past, device=self.device)[:, None]  # [G, T]
        return view, torch.cat([real, real.new_ones(g, cols)], dim=1)

    def _layers(self, states: torch.Tensor, position_ids: torch.Tensor, kv: DynamicCache, keep: tuple[int, ...] = (),
                kept: list[torch.Tensor] | None = None, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Top layers over `states` [(batch,) T, hidden] at positions position_ids [batch or 1, T] ->
        [batch, T, hidden]; the states at hidden_states indices `keep` are appended to `kept` in `keep` order.
        `padding` [batch, past + T] (True = a real key) masks the padded context columns of a `_view`.

        The mask is sized from the decoder's first attention layer (`layer_idx`): layer 0 holds no keys
        here, and the default would size the mask from it.
        """
        h = states.to(device=self.device, dtype=self.dtype)
        if h.dim() == 2:
            h = h[None]  # [1, T, hidden]
        position_ids = position_ids.expand(h.shape[0], -1)  # [batch, T]
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)  # (cos, sin) [batch, T, head_dim]
        mask = None if not self.attention_layers else create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=padding, cache=kv,
            position_ids=position_ids, layer_idx=self.attention_layers[0],
        )
        seen: dict[int, torch.Tensor] = {}
        for layer_id, layer in zip(self.layer_ids, self.layers):
            # Linear-attention layers take no mask: their context is their state, and a row's padding comes
            # after its real positions, which a recurrence never reads back.
            layer_mask = None if layer_id in self.linear_layers else mask
            h = layer(h, attention_mask=layer_mask, position_ids=position_ids, cache=kv, use_cache=True,
                      position_embeddings=position_embeddings)
            if layer_id + 1 in keep:  # index i = output of layer i-1
                seen[layer_id + 1] = h
        if kept is not None:
            kept.extend(seen[i] for i in keep)
        return h


def _append(layer, keys: torch.Tensor, values: torch.Tensor, row: int, past: int, t: int, m: int,
            alone: bool) -> None:
    """Give a request's attention layer the keys/values of its m new context positions from a pass's
    `view` layer (keys/values [G, kv_heads, t + W, head_dim]; row `row`, whose context held `past` columns of
    the t). `alone` (a one-row pass, so past == t): the layer keeps a view of the pass's tensors (no copy,
    as a crop would); else a tensor of its own (a view would keep every row's tensors alive)."""
    if alone:
        k, v = keys[:, :, :t + m], values[:, :, :t + m]
    else:
        k = torch.cat([keys[row:row + 1, :, :past], keys[row:row + 1, :, t:t + m]], dim=2)
        v = torch.cat([values[row:row + 1, :, :past], values[row:row + 1, :, t:t + m]], dim=2)
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v


def _set_linear_state(layer, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Give a LinearAttentionLayer of a DynamicCache the state conv [B, conv_dim, kernel] and recurrent
    [B, v_heads, k_dim, v_dim] (copied: the layer updates its tensors in place)."""
    if not layer.is_conv_states_initialized[0]:
        layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent)
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(recurrent)
    layer.has_previous_state[0] = True  # the next forward continues from it (not a prefill from zeros)


def keep_decoder_parts(model, n_layers: int, device: str | torch.device) -> None:
    """Of the target `model`, only what a decoder of its top `n_layers` layers reads stays, on `device`: those
    layers, the final norm, the rotary tables and the LM head. The other layers and an untied embedding go to the
    meta device (their memory freed; anything that still ran them would fail loudly). So a drafter holds a few of a
    large target's layers, not all of them, and loads the target on the CPU first (the drafter worker's
    `load_drafter_target`)."""
    base = model.model
    first = len(base.layers) - n_layers
    for i, layer in enumerate(base.layers):
        layer.to(device if i >= first else "meta")
    head = model.get_output_embeddings()
    for part in (base.norm, base.rotary_emb, head):
        part.to(device)
    if base.embed_tokens.weight is not head.weight:  # tied: the head's own weight, kept
        base.embed_tokens.to("meta")
