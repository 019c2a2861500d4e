"""The foresight adapter compiled ahead of time with AOTInductor (CPU): a graph for one request's block, one for a
context's extension.

Each pipelined round the adapter (models/adapter.py) predicts the target's states of the block under verification
from its tokens and the request's cached context keys/values. Eager, its stages (on the embedded default four copied
target layers) spend about as long in Python and small ops (norms, rotary embedding, the mask, concatenations) as in
their matrix products, on the drafter's one core while the target verifies: the time foresight then lacks to
pre-draft. The graph takes one row: the block's tokens (1 to MAX_TOKENS) at the positions right after the context it
continues, and the context's keys/values of every attention layer (1 to MAX_COLUMNS positions), symbolic sizes both;
the mask and positions are made inside (the whole context, causal in the block). It returns the predicted states
[1, L, n_idx * hidden]. The second graph makes every attention layer's keys/values of a context's new true states
(1 to MAX_CONTEXT_TOKENS of them: the round's, or a prompt's), which `Adapter.extend_context` appends to the context.

Blocks of several rows (several requests at once, a refresh's rows), a block at position 0, and adapters with
linear-attention layers run eager. Packages share the target's cache folder (models/compiled_step.py) under a key of
the weights, the stages, the code the trace runs through, torch and the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .compiled_parts import AUTOTUNE, compiled_part, part_info
from .compiled_step import compile_package, load_package, package_key, prune_stale

# Modules whose code runs inside the traced graph (besides transformers'): a change recompiles.
TRACED_MODULES = (__name__, "foresight.models.adapter", "foresight.models.adapter_layers",
                  "foresight.models.draft_model", "foresight.models.cpu_linear")
MAX_TOKENS = 256  # block positions of one row (a block is gamma + 1; a few blocks side by side at most)
MAX_COLUMNS = 1 << 20  # context positions
MAX_CONTEXT_TOKENS = 1 << 14  # new positions of one context extension (a whole prompt at a request's first round)
EXAMPLE_CONTEXT, EXAMPLE_TOKENS = 8, 3  # the trace's example sizes (never 1: the tracer would take it for a constant)


def by_stage(flat: list, layout: list[int]) -> list[list]:
    """A list of one item per layer of the adapter, stage after stage -> one list per stage (`layout`: their sizes)."""
    starts = [sum(layout[:s]) for s in range(len(layout))]
    return [flat[start:start + size] for start, size in zip(starts, layout)]


class AdapterBody(nn.Module):
    """What is compiled: the adapter's stages over one row's block, continuing its whole context."""

    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter
        self.layout = [len(stage) for stage in adapter.stages]

    def forward(self, tokens, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """tokens [1, L] at positions T..T+L-1; keys/values of every layer, stage by stage, [1, T, kv_heads, head_dim]
        -> predicted states [1, L, n_idx * hidden]."""
        context, width = keys[0].shape[1], tokens.shape[1]
        positions = torch.arange(width, device=tokens.device)[None] + context  # [1, L]
        columns = torch.arange(context + width, device=tokens.device)
        mask = (columns[None, :] <= positions[0, :, None])[None]  # [1, L, T + L]: the whole context, causal after
        outs = self.adapter.run_stages(self.adapter.embed(tokens), by_stage(keys, self.layout),
                                       by_stage(values, self.layout), positions, mask)
        return torch.cat(outs, dim=-1)


class ContextBody(nn.Module):
    """What is compiled for a context extension: every attention layer's keys/values of the new true states."""

    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter

    def forward(self, states, positions):
        """states [1, n, n_idx * hidden] (true states, target_indices order) at positions [1, n] -> the keys of every
        layer, stage by stage, then their values, [1, n, kv_heads, head_dim] each."""
        keys, values = self.adapter.context_kv(states, positions)
        return [k for stage in keys for k in stage] + [v for stage in values for v in stage]


class CompiledAdapter:
    """An AOTInductor graph of `adapter`'s prediction of one row's block, built for `threads`."""

    def __init__(self, adapter, cache_dir: Path, threads: int = 1, autotune: bool = True):
        """`autotune`: inductor picks each matrix product's kernel by timing the candidates at compile time (as the
        compiled decoder does: models/compiled_decoder.py)."""
        self.adapter = adapter
        self.cache_dir = cache_dir
        self.threads = threads
        self.autotune = autotune
        self.graph = None  # the prediction
        self.context_graph = None  # a context extension
        self.layout = [len(stage) for stage in adapter.stages]
        self.compile_s = 0.0  # seconds spent compiling (0 when the packages came from the cache)
        self.loaded = 0  # packages loaded from the cache
        self.passes = 0  # predictions the graph ran
        self.eager_passes = 0  # predictions it did not take (several rows, a block at position 0, too long a block)
        self.extensions = 0  # context extensions the context graph ran

    def takes(self, rows: int, tokens: int, start: int) -> bool:
        """Whether the graph serves `rows` rows of `tokens` tokens continuing a context of `start` positions."""
        takes = rows == 1 and 1 <= tokens <= MAX_TOKENS and 1 <= start <= MAX_COLUMNS
        self.eager_passes += not takes
        return takes

    def run(self, actx, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [1, L] continuing `actx` (an `AdapterContext`) at position `start` (its positions before it are
        the context) -> predicted states [1, L, n_idx * hidden]."""
        keys = [k[:start][None] for stage in actx.keys for k in stage]  # [1, T, kv_heads, head_dim] each
        values = [v[:start][None] for stage in actx.values for v in stage]
        self.passes += 1
        return self.graph(tokens, keys, values)

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor):
        """`Adapter.context_kv` through the context graph: states [1, n, n_idx * hidden] at positions [1, n] -> per
        stage, per layer, keys and values [1, n, kv_heads, head_dim]; None when it does not take n positions."""
        if not 1 <= states.shape[1] <= MAX_CONTEXT_TOKENS:
            return None
        flat = self.context_graph(states.to(self.adapter.dtype), positions)
        self.extensions += 1
        half = len(flat) // 2
        return by_stage(flat[:half], self.layout), by_stage(flat[half:], self.layout)

    def fingerprint(self) -> str:
        adapter = self.adapter
        return package_key(adapter, adapter.config.to_dict(), [self.threads, self.autotune], TRACED_MODULES)

    def build(self) -> None:
        """Load the two packages from the cache, compiling the missing ones first."""
        key = self.fingerprint()
        path, context_path = self.cache_dir / f"adapter-{key}.pt2", self.cache_dir / f"adapter-context-{key}.pt2"
        self.graph, seconds = load_package(path, lambda: self.compile(path), "the foresight adapter's prediction")
        self.context_graph, context_seconds = load_package(context_path, lambda: self.compile_context(context_path),
                                                           "the foresight adapter's context extension")
        self.compile_s = (seconds or 0.0) + (context_seconds or 0.0)
        self.loaded = int(seconds is None) + int(context_seconds is None)
        prune_stale(self.cache_dir)

    @torch.inference_mode()
    def compile(self, path: Path) -> None:
        """Trace the prediction (its block and context lengths symbolic) and compile it into `path`."""
        adapter = self.adapter
        layers = [layer for stage in adapter.stages for layer in stage]
        dtype, device = adapter.dtype, adapter.device
        tokens = torch.export.Dim("tokens", min=1, max=MAX_TOKENS)
        context = torch.export.Dim("context", min=1, max=MAX_COLUMNS)
        keys = [torch.zeros(1, EXAMPLE_CONTEXT, layer.kv_heads, layer.head_dim, dtype=dtype, device=device)
                for layer in layers]
        example = (torch.zeros(1, EXAMPLE_TOKENS, dtype=torch.long, device=device), keys, [k.clone() for k in keys])
        per_layer = [{1: context}] * len(layers)
        program = torch.export.export(AdapterBody(adapter), example, strict=False,
                                      dynamic_shapes=({1: tokens}, per_layer, per_layer))
        compile_package(program, path, self.threads, self.options())

    @torch.inference_mode()
    def compile_context(self, path: Path) -> None:
        """Trace a context extension (its number of new positions symbolic) and compile it into `path`."""
        adapter = self.adapter
        tokens = torch.export.Dim("tokens", min=1, max=MAX_CONTEXT_TOKENS)
        width = len(adapter.stages) * adapter.config.hidden_size
        example = (torch.zeros(1, EXAMPLE_TOKENS, width, dtype=adapter.dtype, device=adapter.device),
                   torch.arange(EXAMPLE_CONTEXT, EXAMPLE_CONTEXT + EXAMPLE_TOKENS, device=adapter.device)[None])
        program = torch.export.export(ContextBody(adapter), example, strict=False,
                                      dynamic_shapes=({1: tokens}, {1: tokens}))
        compile_package(program, path, self.threads, self.options())

    def options(self) -> dict:
        return AUTOTUNE if self.autotune else {}


def compile_adapter_refusal(adapter, device: str) -> str | None:
    """Why `adapter` on `device` cannot run a compiled prediction (None: it can)."""
    if device != "cpu":
        return "the compiled adapter prediction is built for CPUs only (CUDA graphs are not built yet)"
    if adapter.has_linear:
        return "the compiled adapter prediction takes full-attention layers only"
    return None


def compiled_adapter_for(adapter, choice: str, device: str, cache_dir: Path, threads: int = 1,
                         autotune: bool = True) -> CompiledAdapter | None:
    """Give `adapter` its compiled prediction and context extension as `choice` (the drafter's `--drafter-compile`)
    wants (`compiled_part`); the graphs, or None where they stay eager."""
    compiled = compiled_part(choice, compile_adapter_refusal(adapter, device), "foresight adapter",
                             "its prediction and context extension",
                             lambda: CompiledAdapter(adapter, cache_dir, threads, autotune))
    adapter.compiled = compiled
    return compiled


def compiled_adapter_info(adapter) -> dict:
    """What of the foresight adapter runs compiled, for the bench's report (`part_info`)."""
    return part_info(getattr(adapter, "compiled", None), "adapter_pass", "adapter_")
