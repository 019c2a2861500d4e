"""The draft model's block pass and context extension compiled ahead of time with AOTInductor (CPU): one graph
each, for every batch.

A block pass of the draft model (its few layers over a block of positions after each row's cached context, then
the LM head over its vocabulary subset) is what every drafting strategy runs: a sync draft, a pipelined fallback,
foresight's pre-drafted outcomes, each Jacobi pass; the context extension (the new positions' keys and values) is
what each round adds before it. Eager, most of a pass of the shipped draft model is Python and small ops around
its matrix products (norms, rotary embedding, the mask, the softmax over the subset). The pass graph takes every
batch: its rows (1 to MAX_ROWS), positions per row (1 to MAX_TOKENS) and context columns (1 to the draft model's
window) stay symbolic, and it returns each position's draft and confidence, so the logits [B, n, V'] never leave
it; the extension graph takes 1 to a window of new positions. Results equal the eager forwards' up to float
rounding (another fusion order).

Packages share the target's cache folder (models/compiled_step.py) under a key of the weights, the code the trace
runs through, torch and the CPU, so a second start loads the graphs in seconds.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .compiled_parts import compiled_part, part_info
from .compiled_step import compile_package, load_package, package_key, prune_stale
from .draft_model import ContextBatch, DraftModel

# Modules whose code runs inside the traced graphs: a change recompiles.
TRACED_MODULES = (__name__, "foresight.models.draft_model", "foresight.models.cpu_linear")
MAX_ROWS = 64  # rows (blocks) of one pass: a sync batch, or B outcomes of each request foresight pre-drafts
MAX_TOKENS = 32  # positions per row: a block (anchor + drafts)
EXAMPLE = 3  # the size each symbolic dimension is traced at (never 1: the tracer would take it for a constant)


class DraftPassBody(nn.Module):
    """What is compiled: `DraftModel.block_pass` and the drafts with their confidence."""

    def __init__(self, model: DraftModel):
        super().__init__()
        self.model = model

    def forward(self, inputs, start, anchor_state, keys: list[torch.Tensor], values: list[torch.Tensor], valid):
        """inputs [B, n] ids; the `ContextBatch` fields -> (drafts [B, n] full-vocabulary ids, confidence [B, n])."""
        return self.model.ids_and_confidence(self.model.block_pass(inputs, start, anchor_state, keys, values, valid))


class NewContextBody(nn.Module):
    """What is compiled: `DraftModel.new_context`, the keys/values of a request's new context positions."""

    def __init__(self, model: DraftModel):
        super().__init__()
        self.model = model

    def forward(self, states, positions):
        """states [n, n_src*H_t] fp32, positions [n] -> (keys, values per layer [n, kv, d], newest state [H])."""
        return self.model.new_context(states, positions)


class CompiledDraft:
    """AOTInductor graphs of `model`'s block pass and context extension, built for `threads` intra-op threads."""

    GRAPHS = ("pass", "context")

    def __init__(self, model: DraftModel, cache_dir: Path, threads: int = 1):
        self.model = model
        self.cache_dir = cache_dir
        self.threads = threads
        self.max_columns = model.config.context_window
        self.graphs: dict[str, object] = {}
        self.compile_s = 0.0  # seconds spent compiling (0 when the packages came from the cache)
        self.loaded = 0  # packages loaded from the cache

    def takes(self, rows: int, tokens: int, columns: int) -> bool:
        """Whether the pass graph serves `rows` blocks of `tokens` positions after `columns` context columns."""
        return 1 <= rows <= MAX_ROWS and 1 <= tokens <= MAX_TOKENS and 1 <= columns <= self.max_columns

    def takes_context(self, positions: int) -> bool:
        """Whether the context graph serves `positions` new context positions of one request."""
        return 1 <= positions <= self.max_columns

    def __call__(self, inputs: torch.Tensor, batch: ContextBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`DraftModel.pass_ids` through the graph."""
        return tuple(self.graphs["pass"](inputs, *batch))

    def context(self, states: torch.Tensor, positions: torch.Tensor):
        """`DraftModel.new_context` through the graph."""
        keys, values, last = self.graphs["context"](states, positions)
        return list(keys), list(values), last

    def fingerprint(self) -> str:
        return package_key(self.model, self.model.config.to_dict(), [self.threads, MAX_ROWS, MAX_TOKENS,
                                                                     self.max_columns], TRACED_MODULES)

    def build(self) -> None:
        """Load the packages from the cache, compiling the missing ones first."""
        key = self.fingerprint()
        for name in self.GRAPHS:
            path = self.cache_dir / f"draft-{key}-{name}.pt2"
            graph, seconds = load_package(path, lambda: self.compile(name, path), f"the draft model's {name} graph")
            self.graphs[name] = graph
            self.compile_s += seconds or 0.0
            self.loaded += int(seconds is None)
        prune_stale(self.cache_dir)

    @torch.inference_mode()
    def compile(self, name: str, path: Path) -> None:
        """Trace and compile graph `name` (its sizes symbolic) into the package `path`."""
        body, example, dynamic = self.pass_trace() if name == "pass" else self.context_trace()
        compile_package(torch.export.export(body, example, strict=False, dynamic_shapes=dynamic), path, self.threads)

    def pass_trace(self):
        """The pass's body, example inputs (EXAMPLE rows of EXAMPLE positions after EXAMPLE + 1 context columns)
        and their symbolic sizes: rows, positions, context columns."""
        cfg, model = self.model.config, self.model
        rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
        tokens = torch.export.Dim("tokens", min=1, max=MAX_TOKENS)
        columns = torch.export.Dim("columns", min=1, max=self.max_columns)
        width = EXAMPLE + 1
        kv = [torch.zeros(EXAMPLE, width, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=model.device)
              for _ in model.layers]
        example = (torch.zeros(EXAMPLE, EXAMPLE, dtype=torch.long), torch.full((EXAMPLE,), width),
                   torch.zeros(EXAMPLE, 1, cfg.hidden_size, dtype=model.dtype), kv, [k.clone() for k in kv],
                   torch.ones(EXAMPLE, width, dtype=torch.bool))
        context = [{0: rows, 1: columns}] * len(model.layers)
        return DraftPassBody(model), example, ({0: rows, 1: tokens}, {0: rows}, {0: rows}, context, context,
                                               {0: rows, 1: columns})

    def context_trace(self):
        """The context extension's body, example inputs (EXAMPLE new positions) and their symbolic size."""
        cfg = self.model.config
        positions = torch.export.Dim("positions", min=1, max=self.max_columns)
        example = (torch.zeros(EXAMPLE, len(cfg.target_layers) * cfg.target_hidden_size), torch.arange(EXAMPLE))
        return NewContextBody(self.model), example, ({0: positions}, {0: positions})


def compile_draft_refusal(device: str) -> str | None:
    """Why the draft model on `device` cannot run a compiled pass (None: it can)."""
    return None if device == "cpu" else "the compiled draft pass is built for CPUs only (CUDA graphs are not built yet)"


def compiled_draft_for(model: DraftModel, choice: str, device: str, cache_dir: Path, threads: int = 1) -> bool:
    """Give `model` its compiled block pass and context extension as `choice` ("auto", "on", "off") wants
    (`compiled_part`; "on" where they cannot be built is a config error); True when it has them."""
    from ..config import ConfigError

    refusal = compile_draft_refusal(device)
    if choice == "on" and refusal is not None:
        raise ConfigError(f"drafter_compile: {refusal}")
    model.compiled = compiled_part(choice, refusal, "draft model", "its block pass",
                                   lambda: CompiledDraft(model, cache_dir, threads))
    return model.compiled is not None


def compiled_draft_info(model: DraftModel | None) -> dict:
    """What of the drafter runs compiled, for the bench's report (`part_info`): the draft model's block pass."""
    return part_info(getattr(model, "compiled", None), "draft_pass")
