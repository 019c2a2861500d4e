"""The foresight decoder's pass compiled ahead of time with AOTInductor (CPU): one graph for one request's row.

Each pipelined round the decoder (models/decoder.py: the target's top layers, its final norm) runs once over one
request's row: the new context positions' true states, then the adapter's predicted states of the block under
verification. Eager, that pass of the embedded default's 15 top layers spends about as long in Python and small ops
(norms, rotary embedding, the mask, residuals, cache bookkeeping) as in its matrix products, on the drafter's one
core, while the target verifies: what foresight cannot finish in that time is not pre-drafted. The graph takes the
row's positions (1 to MAX_TOKENS), the key columns it attends and the capacity of the KV buffers as symbolic sizes,
writes the row's keys/values into the request's `SlotLayer` buffers in place at its positions (models/slot_kv.py; the
block's are scratch, overwritten by the next pass) and returns the final-normed states and the states at the indices
the draft model reads; the LM head over the vocabulary subset stays outside (one matrix product).

Passes of several rows at once (several requests' rows in one batch, a refresh's rows over one context), blocks that
start before the context's end, and targets with linear-attention layers run eager. Packages share the target's
cache folder (models/compiled_step.py) under a key of the weights, the layers, the code the trace runs through,
torch and the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .compiled_parts import AUTOTUNE, compiled_part, part_info
from .compiled_step import BufferWrites, causal_mask, compile_package, load_package, package_key, prune_stale
from .slot_kv import no_keys

# Modules whose code runs inside the traced graph (besides transformers'): a change recompiles.
TRACED_MODULES = (__name__, "foresight.models.compiled_step", "foresight.models.cpu_linear")
MAX_TOKENS = 1 << 14  # positions of one pass: the new context states (a whole prompt at a request's first round) + block
MAX_COLUMNS = 1 << 20  # key columns attended / buffer capacity
EXAMPLE_PAST, EXAMPLE_TOKENS = 8, 3  # the trace's example sizes (never 1: the tracer would take it for a constant)


class LayerWrites(BufferWrites):
    """`BufferWrites` for a slice of the target's layers: layer `first + j` writes into buffers j."""

    def __init__(self, keys, values, at, width, first: int):
        super().__init__(keys, values, at, width)
        self.first = first

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states, layer_idx - self.first)


class DecoderBody(nn.Module):
    """What is compiled: the decoder's layers and final norm over one row, keeping the states at `keep`."""

    def __init__(self, decoder, keep: tuple[int, ...]):
        super().__init__()
        self.layers = nn.ModuleList(decoder.layers)
        self.norm = decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.layer_ids = list(decoder.layer_ids)
        self.keep = keep

    def forward(self, states, positions, mask, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """states [1, W, hidden] at positions [1, W]; mask [1, 1, W, T] bool (True: attend); keys/values per layer
        [1, kv_heads, C, head_dim] -> (final-normed states [1, W, hidden], the states at `keep` [1, W, k * hidden]
        or an empty [1, W, 0])."""
        torch._check(mask.shape[-1] <= keys[0].shape[2])
        cache = LayerWrites(keys, values, positions, mask.shape[-1], self.layer_ids[0])
        rope = self.rotary_emb(states, position_ids=positions)  # (cos, sin) [1, W, head_dim]
        h, kept = states, {}
        for layer_id, layer in zip(self.layer_ids, self.layers):
            h = layer(h, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                      position_embeddings=rope)
            if layer_id + 1 in self.keep:  # index i = output of layer i-1
                kept[layer_id + 1] = h
        rows = torch.cat([kept[i] for i in self.keep], dim=-1) if self.keep else h.new_zeros(*h.shape[:2], 0)
        return self.norm(h), rows


class CompiledDecoder:
    """An AOTInductor graph of `decoder`'s pass over one row, returning the states at `keep`, built for `threads`."""

    def __init__(self, decoder, keep: tuple[int, ...], cache_dir: Path, threads: int = 1, autotune: bool = True):
        """`autotune`: inductor picks each matrix product's kernel by timing the candidates (its own CPU
        micro-kernels, aten's) at compile time: on the embedded default's decoder (bf16, 2-core Xeon with AMX) a
        pass of 9 positions 17.7 -> 12.5 ms, compiling 48 -> 76 s."""
        self.decoder = decoder
        self.keep = tuple(keep)
        self.cache_dir = cache_dir
        self.threads = threads
        self.autotune = autotune
        self.graph = None
        self.compile_s = 0.0  # seconds spent compiling (0 when the package came from the cache)
        self.loaded = 0  # packages loaded from the cache
        self.passes = 0  # passes the graph ran
        self.eager_passes = 0  # single-row passes it did not take (another `keep`, too many positions)

    def takes(self, tokens: int, keep: tuple[int, ...]) -> bool:
        """Whether the graph serves a row of `tokens` positions keeping the states at `keep`."""
        return 1 <= tokens <= MAX_TOKENS and tuple(keep) == self.keep

    def run(self, cache, states: torch.Tensor, past: int, held: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass over states [1, W, hidden] at positions past.. of `cache` (a `DecoderCache` whose attention
        layers are `SlotLayer`s holding its first `past` positions), which then holds `held` positions (the new
        context ones; the rest were scratch) -> (final-normed states [1, W, hidden], kept [1, W, k * hidden])."""
        width = states.shape[1]
        layers = [cache.kv.layers[i] for i in self.decoder.attention_layers]
        like = () if past else no_keys(self.decoder.config, states.dtype, states.device)
        buffers = [layer.room(past + width, *like) for layer in layers]  # (keys, values) [1, kv_heads, C, D]
        positions = torch.arange(past, past + width, device=states.device)[None]  # [1, W]
        normed, kept = self.graph(states, positions, causal_mask(past, width).to(states.device),
                                  [keys for keys, _ in buffers], [values for _, values in buffers])
        for layer in layers:
            layer.hold(held)
        self.passes += 1
        return normed, kept

    def fingerprint(self) -> str:
        model = self.decoder.model
        return package_key(nn.ModuleList(self.decoder.layers), model.config.to_dict(),
                           [self.decoder.layer_ids, self.keep, self.threads, self.autotune], TRACED_MODULES)

    def build(self) -> None:
        """Load the package from the cache, compiling it first if it is missing."""
        path = self.cache_dir / f"decoder-{self.fingerprint()}.pt2"
        self.graph, seconds = load_package(path, lambda: self.compile(path), "the foresight decoder's pass")
        self.compile_s = seconds or 0.0
        self.loaded = int(seconds is None)
        prune_stale(self.cache_dir)

    @torch.inference_mode()
    def compile(self, path: Path) -> None:
        """Trace the pass (its positions, key columns and buffer capacity symbolic) and compile it into `path`."""
        config = self.decoder.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype, device = self.decoder.dtype, self.decoder.device
        tokens = torch.export.Dim("tokens", min=1, max=MAX_TOKENS)
        columns = torch.export.Dim("columns", min=1, max=MAX_COLUMNS)
        capacity = torch.export.Dim("capacity", min=2, max=MAX_COLUMNS)
        capacity_size = 4 * (EXAMPLE_PAST + EXAMPLE_TOKENS)
        keys = [torch.zeros(1, config.num_key_value_heads, capacity_size, dim, dtype=dtype, device=device)
                for _ in self.decoder.attention_layers]
        example = (torch.zeros(1, EXAMPLE_TOKENS, config.hidden_size, dtype=dtype, device=device),
                   torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + EXAMPLE_TOKENS, device=device)[None],
                   causal_mask(EXAMPLE_PAST, EXAMPLE_TOKENS).to(device), keys, [k.clone() for k in keys])
        buffers = [{2: capacity}] * len(keys)
        program = torch.export.export(DecoderBody(self.decoder, self.keep), example, strict=False,
                                      dynamic_shapes=({1: tokens}, {1: tokens}, {2: tokens, 3: columns}, buffers,
                                                      buffers))
        compile_package(program, path, self.threads, AUTOTUNE if self.autotune else {})


def compile_decoder_refusal(decoder, device: str) -> str | None:
    """Why `decoder` on `device` cannot run a compiled pass (None: it can)."""
    if device != "cpu":
        return "the compiled decoder pass is built for CPUs only (CUDA graphs are not built yet)"
    if decoder.linear_layers:
        return "the compiled decoder pass takes full-attention layers only"
    return None


def compiled_decoder_for(decoder, keep: tuple[int, ...], choice: str, device: str, cache_dir: Path,
                         threads: int = 1, autotune: bool = True) -> CompiledDecoder | None:
    """Give `decoder` its compiled pass as `choice` (the drafter's `--drafter-compile`) wants (`compiled_part`); the
    graph, or None where the pass stays eager."""
    compiled = compiled_part(choice, compile_decoder_refusal(decoder, device), "foresight decoder", "its pass",
                             lambda: CompiledDecoder(decoder, keep, cache_dir, threads, autotune))
    if compiled is not None:
        decoder.use_compiled(compiled)
    return compiled


def compiled_decoder_info(decoder) -> dict:
    """What of the foresight decoder runs compiled, for the bench's report (`part_info`)."""
    return part_info(getattr(decoder, "compiled", None), "decoder_pass", "decoder_")
