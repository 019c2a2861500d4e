"""A target's decoding forwards compiled ahead of time with AOTInductor: a few new tokens of one request over
its KV cache, as one C++ graph per token count, and the new tokens of several requests (plain steps and verify
blocks under load) as graphs whose batch size and token count stay symbolic.

Eager, a 1-token step of the embedded default spends as long in Python and small ops (norms, rotary embedding,
residuals, cache bookkeeping) as in its matrix products. `torch.export` traces the model's body once per token
bucket (1, 2, 4, 8, ... up to the block size) and `torch._inductor.aoti_compile_and_package` turns each trace into
a shared library: weights frozen in (CPU: prepacked for oneDNN; int4: inductor's weight-only int4 micro-kernels
when `autotune`), small ops fused, no Python and no guards per call. The shapes that change from step to step
stay symbolic: the key columns attended (W) and the capacity of the KV buffers (C). A forward of fewer tokens than
its bucket is padded (the padding's keys land past what the cache keeps; its outputs are not read).

The graph writes the new keys/values into the request's buffers in place (at the fed positions) and attends to
their first W columns, so the buffers must already hold the request's past in columns [0, T) and have room for the
bucket (models/slot_kv.py). A batched graph does the same for each row of batched buffers
(target_worker/batched_kv.py: row b holds request b's past), every row padded to the widest row's tokens. Which
path a quantized target's linear layers take depends on their rows (requests x tokens): the weight-only kernel up
to a few rows (int4: 8, int8: 2), a dense copy past them (models/weight_only.py). So the batched graphs are two:
one new token of each of 2 up to that many requests (the kernel), and the blocks' graph, 1 up to a block of tokens
to each of 2 up to MAX_BATCH requests, traced with every linear on its dense copy and fed more rows than the kernel
takes (narrow batches padded wider), as an eager forward of as many rows is. A dense target has the blocks' graph
only. Rows padded to the widest block cost what real tokens cost, while the eager packed forward computes only the
real ones (target_worker/packed_step.py): a batch padded past MAX_PADDING rows per real token (one long block among
single tokens) runs eager.

A prompt's chunks (more tokens than a block, up to `--max-num-batched-tokens`) run one graph of one request whose
token count stays symbolic, fed as many tokens as the chunk has; its linears multiply by the dense copies, as an
eager forward of that many rows does. A prompt's first chunk goes through it too: it writes into empty buffers.

A graph returns the last decoder layer's output before the final norm (the runner's logit head takes it from there,
fp32 included) and the hidden states the drafter reads.

The graphs are compiled for the most threads a forward may get (the target's own plus the drafter's it borrows
while the drafter idles, target_worker/step_threads.py) with inductor's dynamic threads: each parallel region then
takes the thread count torch is set to when it runs, so one package serves a step on one core and on two. (A
package compiled for one thread has no parallel regions at all: borrowing a core would not speed it.)

Compiling costs tens of seconds per bucket: packages are kept in the cache folder under a key of everything that
shapes them (weights, dtype, layers, bucket, torch and this module's source), so a second start loads them.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .int4_linear import serves_int4
from .weight_only import dense_products, kernel_rows

log = logging.getLogger("foresight.compiled_step")

# Modules whose code runs inside the traced forward (besides transformers'): a change recompiles.
TRACED_MODULES = (__name__, "foresight.target_worker.packed_step", "foresight.target_worker.small_attention",
                  "foresight.models.cpu_linear", "foresight.models.weight_only", "foresight.models.int4_linear",
                  "foresight.models.int8_linear")
STALE_DAYS = 14  # a package no start has loaded for this long is deleted (prune_stale)
MAX_COLUMNS = 1 << 20  # the symbolic key columns / buffer capacity may be anything up to this
EXAMPLE_PAST = 8  # positions in the KV buffers of the example inputs the trace runs on
MAX_BATCH = 64  # requests a batched graph takes at most (a larger plain step runs eager)
# The blocks' graph computes every row at the widest row's width; the eager packed forward computes only the real
# tokens. Past this many computed rows per real token the eager forward is about as fast or faster: int4, bf16,
# 2 threads, 2-16 requests (scripts/batch_step.py ... compiled 4|4,3|2,1|4,1|8,1 padded): the graph 1.14-1.49x eager
# at 1.0-1.33 rows per token at every batch size, 0.96x at 16 requests of 1.6 and 0.83x of 1.78.
MAX_PADDING = 1.5


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What one graph feeds: `tokens` new tokens (up to `tokens_to` where that is more: symbolic) to each of
    `rows[0]`..`rows[1]` requests (a range: symbolic)."""

    tokens: int
    rows: tuple[int, int] = (1, 1)
    tokens_to: int = 0

    @property
    def name(self) -> str:
        low, high = self.rows
        tokens = f"{self.tokens}-{self.tokens_to}" if self.blocks else str(self.tokens)
        return tokens if high == 1 else f"{tokens}x{low}-{high}"

    @property
    def batched(self) -> bool:
        """A graph of several requests."""
        return self.rows[0] > 1

    @property
    def blocks(self) -> bool:
        """A graph of a symbolic number of tokens per request (verify blocks of several requests)."""
        return self.tokens_to > self.tokens

    def takes(self, rows: int, tokens: int) -> bool:
        """Whether this graph serves `tokens` new tokens (a row's padded width) to each of `rows` requests."""
        return (self.rows[0] <= rows <= self.rows[1]
                and (self.tokens <= tokens <= self.tokens_to if self.blocks else tokens == self.tokens))

    @staticmethod
    def example(low: int, high: int) -> int:
        """The size a symbolic dimension over [low, high] is traced at (never 1: the tracer would take it for a
        constant)."""
        return min(high, max(low, 2) + 1) if low < high else low

    @property
    def example_rows(self) -> int:
        return self.example(*self.rows)

    @property
    def example_tokens(self) -> int:
        return self.example(self.tokens, self.tokens_to) if self.blocks else self.tokens


class StepBody(nn.Module):
    """What is compiled: the base model over embedded tokens at `positions`, writing into and attending over the
    buffers."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]):
        super().__init__()
        self.base = model.model
        self.layers = layers

    def forward(self, embeds, positions, mask, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """embeds [B, L, hidden] (the input embeddings of the fed tokens: the table stays out of the graph);
        positions [B, L]; mask [B, 1, L, W] bool (True: attend); keys/values per layer [B, kv_heads, C, D]
        -> (last layer's output before the final norm [B, L, hidden], states at `layers` [B, L, width] or an
        empty [B, L, 0])."""
        torch._check(mask.shape[-1] <= keys[0].shape[2])
        norm = self.base.norm
        self.base.norm = recorder = InputRecorder(norm)  # only while tracing: the graph keeps the norm's input
        try:
            out = self.base(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=True,
                            cache=BufferWrites(keys, values, positions, mask.shape[-1]),
                            output_hidden_states=list(self.layers) if self.layers else None)
        finally:
            self.base.norm = norm
        if self.layers:
            states = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)
        else:
            states = recorder.input.new_zeros(*embeds.shape[:2], 0)
        return recorder.input, states


class InputRecorder(nn.Module):
    """A module that runs `module` and keeps its input (a forward hook would change which tensor transformers
    reports as the last hidden state)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.input = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input = x
        return self.module(x)


class BufferWrites:
    """The `cache` the model sees inside the graph: row b's new keys/values go to columns `at[b]` of its
    buffers, and attention reads the first `width` columns."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], at: torch.Tensor, width):
        """at [B, L]: the fed positions of each row."""
        self.keys, self.values, self.at, self.width = keys, values, at, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, kv_heads, L, D] -> the layer's keys/values [B, kv_heads, W, D]."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.at.shape[0] == 1:  # decided when tracing: one request's graph
            keys.index_copy_(2, self.at[0], key_states)
            values.index_copy_(2, self.at[0], value_states)
        else:
            where = self.at[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
            keys.scatter_(2, where, key_states)
            values.scatter_(2, where, value_states)
        return keys[:, :, :self.width], values[:, :, :self.width]


class CompiledStep:
    """AOTInductor graphs of `model`'s body for forwards of up to max(buckets) new tokens of one request, of one
    new token of each of several requests (`batch_ranges`), and of up to `block_tokens` of each (the blocks')."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...], buckets: tuple[int, ...], cache_dir: Path,
                 autotune: bool, attention=None, threads: int = 1, batch_ranges: tuple[tuple[int, int], ...] = (),
                 block_tokens: int = 0, chunk_tokens: tuple[int, int] = (0, 0)):
        """`layers`: the hidden_states indices each forward returns; `attention`: a context manager factory the
        trace runs inside (the attention implementation the eager forwards use); `threads`: the most intra-op
        threads a forward runs on (the graphs' work is split for that many; fewer at run time run the same split
        on fewer threads); `batch_ranges`: the batch sizes of the 1-token batched graphs (`batch_ranges()`);
        `block_tokens`: the most tokens per request of the blocks' graph (1 to this many tokens to each of 2 to
        MAX_BATCH requests: their verify blocks, and plain steps the 1-token graphs do not take; 0: none);
        `chunk_tokens`: the range of tokens of one request the prompt-chunk graph takes, as many as fed (no
        padding), from past the largest bucket at least ((0, 0): none). The range must not straddle a change of
        path inside the model (the attention's short queries): the trace would keep one path only."""
        self.model = model
        self.layers = tuple(layers)
        self.buckets = tuple(sorted(set(buckets)))
        self.batch_ranges = tuple(batch_ranges)
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.kernel_limit = kernel_rows(model) or 0  # rows up to which the quantized linears take their kernel
        self.max_padding = MAX_PADDING
        self.cache_dir = cache_dir
        self.autotune = autotune
        self.attention = attention
        self.threads = threads
        self.graphs: dict[GraphShape, object] = {}
        self.compile_s = 0.0  # seconds spent compiling (0 when every package came from the cache)
        self.loaded = 0  # packages loaded from the cache

    @property
    def shapes(self) -> list[GraphShape]:
        blocks = [GraphShape(1, (2, MAX_BATCH), self.block_tokens)] if self.block_tokens >= 1 else []
        chunks = [self.chunk_shape] if self.chunk_shape.blocks else []
        return ([GraphShape(bucket) for bucket in self.buckets] + chunks
                + [GraphShape(1, rows) for rows in self.batch_ranges] + blocks)

    @property
    def chunk_shape(self) -> GraphShape:
        """The prompt-chunk graph: `chunk_tokens` tokens of one request, past the largest bucket."""
        low, high = self.chunk_tokens
        return GraphShape(max(low, self.buckets[-1] + 1), (1, 1), high)

    def bucket(self, tokens: int) -> int | None:
        """The graph a forward of `tokens` runs (None: more tokens than the largest bucket)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def single_graph(self, tokens: int) -> tuple[GraphShape, int] | None:
        """The built graph for a forward of `tokens` new tokens of one request and the width they are padded to
        (a bucket's tokens, or as many as fed in the prompt-chunk graph; None: no graph takes them)."""
        bucket = self.bucket(tokens)
        if bucket is not None:
            return GraphShape(bucket), bucket
        if self.chunk_shape in self.graphs and self.chunk_shape.takes(1, tokens):
            return self.chunk_shape, tokens
        return None

    def block_width(self, rows: int, tokens: int) -> int:
        """The width (tokens per request) a batch of `rows` requests feeding up to `tokens` each is padded to in
        the blocks' graph: at least `tokens`, and enough that rows x width exceeds the quantized linears' kernel
        limit, so the graph's dense products are the ones an eager forward of as many rows takes."""
        return max(tokens, -(-(self.kernel_limit + 1) // rows))

    def batch_graph(self, rows: int, tokens: int = 1, fed: int | None = None) -> tuple[GraphShape, int] | None:
        """The built graph for up to `tokens` new tokens (the widest row's) of each of `rows` requests, `fed` of
        them real (default: every row's `tokens`), and the width every row is padded to for it (None: no graph
        takes them, or the blocks' graph would compute more than `max_padding` rows per real token). A 1-token
        graph (the quantized kernel's rows) comes before the blocks' graph."""
        fed = rows * tokens if fed is None else fed
        for shape in self.graphs:
            width = self.block_width(rows, tokens) if shape.blocks else tokens
            if shape.blocks and rows * width > self.max_padding * max(fed, self.kernel_limit + 1):
                continue
            if shape.batched and shape.takes(rows, width):
                return shape, width
        return None

    def build(self) -> None:
        """Load each graph's package from the cache, compiling the missing ones. A batched or prompt-chunk graph
        that fails to compile is left out (its forwards run eager), with the reason logged."""
        key = self.fingerprint()
        for shape in self.shapes:
            try:
                self.graphs[shape] = self.load(shape, self.cache_dir / f"step-{key}-{shape.name}.pt2")
            except Exception as exc:  # noqa: BLE001 -- those graphs are optional; the buckets' are not
                if not (shape.batched or shape.blocks):
                    raise
                log.warning("the %s step failed to compile and runs eager: %s: %s", shape.name,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        prune_stale(self.cache_dir)

    def load(self, shape: GraphShape, path: Path):
        """The graph of `shape` from its package at `path`, compiled first if missing."""
        graph, seconds = load_package(path, lambda: self.compile(shape, path), f"the {shape.name} step")
        self.compile_s += seconds or 0.0
        self.loaded += int(seconds is None)
        return graph

    @torch.inference_mode()
    def compile(self, shape: GraphShape, path: Path) -> None:
        """Trace and compile the forward of `shape` into the package `path`."""
        example = self.example_inputs(shape)
        name = shape.name.replace("-", "_")
        # A prompt's first chunk attends to its own tokens only (no past): columns >= tokens, not > tokens.
        chunks = shape.blocks and not shape.batched
        columns = torch.export.Dim(f"columns_{name}", min=shape.tokens + (not chunks), max=MAX_COLUMNS)
        capacity = torch.export.Dim(f"capacity_{name}", min=shape.tokens + 1, max=MAX_COLUMNS)
        rows = {}
        if shape.rows[0] < shape.rows[1]:
            rows = {0: torch.export.Dim(f"rows_{name}", min=shape.rows[0], max=shape.rows[1])}
        fed = {1: torch.export.Dim(f"tokens_{name}", min=shape.tokens, max=shape.tokens_to)} if shape.blocks else {}
        buffers = [{**rows, 2: capacity}] * len(example[3])
        # A graph of symbolic rows x tokens multiplies by the quantized linears' dense copies (dense_products).
        paths = dense_products() if shape.blocks else nullcontext()
        with self.attention(self.model.config) if self.attention is not None else nullcontext(), paths:
            program = torch.export.export(StepBody(self.model, self.layers), example, strict=False,
                                          dynamic_shapes=({**rows, **fed} or None, {**rows, **fed} or None,
                                                          {**rows, 2: fed.get(1), 3: columns} if fed else
                                                          {**rows, 3: columns}, buffers, buffers))
        options = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if self.autotune else {}
        compile_package(program, path, self.threads, options)

    def example_inputs(self, shape: GraphShape):
        """Inputs of the shapes a forward of `shape` takes, over a past of EXAMPLE_PAST positions."""
        config = self.model.config
        heads = config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        rows, tokens = shape.example_rows, shape.example_tokens
        capacity = 4 * (EXAMPLE_PAST + tokens)
        keys = [torch.zeros(rows, heads, capacity, dim, dtype=dtype) for _ in range(config.num_hidden_layers)]
        values = [torch.zeros_like(k) for k in keys]
        embeds = torch.zeros(rows, tokens, config.hidden_size, dtype=dtype)
        positions = torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + tokens).repeat(rows, 1)  # [rows, tokens]
        mask = causal_mask(EXAMPLE_PAST, tokens).repeat(rows, 1, 1, 1)  # [rows, 1, tokens, past + tokens]
        return embeds, positions, mask, keys, values

    def run_shape(self, shape: GraphShape, ids, positions, mask, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled `StepBody.forward` of `shape` for the tokens `ids` [B, L]."""
        embeds = self.model.get_input_embeddings()(ids)  # [B, L, hidden]
        return tuple(self.graphs[shape](embeds, positions, mask, keys, values))

    def fingerprint(self) -> str:
        """A key of everything a package depends on: the weights (sampled), dtype, layers, the code that traces
        it and the software that compiles it."""
        return package_key(self.model, self.model.config.to_dict(), [self.layers, self.autotune, self.threads],
                           TRACED_MODULES)


def package_key(model: nn.Module, config: dict, settings: list, modules: tuple[str, ...]) -> str:
    """A key of what a compiled package of `model` depends on: its `config`, its weights (sampled), the compile
    `settings`, the code of `modules` the trace runs through (loaded ones only), torch, transformers and the CPU."""
    import transformers

    digest = hashlib.sha256()
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for tensor in weight_tensors(model):
        flat = tensor.detach().reshape(-1)
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(flat[::max(1, flat.numel() // 1024)].float().numpy().tobytes())
    digest.update(json.dumps([*settings, torch.__version__, transformers.__version__, cpu_flags()]).encode())
    for name in modules:
        if name in sys.modules:
            digest.update(inspect.getsource(sys.modules[name]).encode())
    return digest.hexdigest()[:20]


def load_package(path: Path, compile_into, what: str) -> tuple[object, float | None]:
    """The graph in the package at `path`, after `compile_into()` writes it there if it is missing -> (the graph,
    seconds spent compiling; None when it was loaded from the cache). `what`: the graph's name for the log."""
    seconds = None
    if path.is_file():
        path.touch()  # in use: prune_stale keeps it
    else:
        t0 = time.perf_counter()
        compile_into()
        seconds = time.perf_counter() - t0
        log.info("compiled %s in %.1f s -> %s", what, seconds, path)
    return torch._inductor.aoti_load_package(str(path)), seconds


def compile_package(program, path: Path, threads: int, options: dict | None = None) -> None:
    """Compile the exported `program` into the package `path`: weights frozen in, kernels split for `threads`
    (inductor's dynamic threads past one) and tuned for them, plus inductor `options`."""
    import torch._inductor.config as inductor

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")  # two processes may compile at once
    with inductor.patch({"freezing": True, "cpp.dynamic_threads": threads > 1, **(options or {})}), \
            intra_op_threads(threads):
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    partial.replace(path)  # a killed compile leaves no half-written package behind


def built(graphs, owner: str, what: str) -> bool:
    """Whether `graphs.build()` (loading or compiling packages) succeeded; a failure is logged with its reason, and
    what it would have compiled runs eager: a compiler problem never stops a worker."""
    try:
        graphs.build()
    except Exception as exc:  # noqa: BLE001 -- any compiler failure means eager, with the reason logged
        log.warning("%s: compiling %s failed, running eagerly: %s: %s", owner, what, type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


def prune_stale(cache_dir: Path, keep_days: float = STALE_DAYS, now: float | None = None) -> list[Path]:
    """Delete the packages in `cache_dir` (the target's steps and the draft model's pass) no start has used for
    `keep_days` (each change of the model, the traced code, the threads or torch makes a new key and leaves the old
    packages behind, ~70 MB each), and partial ones a compile left an hour ago or more. Returns what it deleted."""
    now = time.time() if now is None else now
    gone = []
    for path in cache_dir.glob("*.pt2"):
        limit = 3600 if path.name.endswith(".partial.pt2") else keep_days * 86400
        try:
            if now - path.stat().st_mtime > limit:
                path.unlink()
                gone.append(path)
        except OSError:  # another process pruned or replaced it first
            continue
    if gone:
        log.info("removed %d compiled packages unused for %g days from %s", len(gone), keep_days, cache_dir)
    return gone


@contextmanager
def intra_op_threads(threads: int):
    """torch's intra-op thread count set to `threads` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_flags() -> str:
    """This CPU's model and instruction set: packages are compiled for the CPU they run on (-march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16] + torch.backends.cpu.get_cpu_capability()


def causal_mask(past: int, tokens: int) -> torch.Tensor:
    """[1, 1, tokens, past + tokens] bool: query i (at position past + i) attends to every column <= past + i."""
    columns = torch.arange(past + tokens)
    return (columns[None, :] <= past + torch.arange(tokens)[:, None])[None, None]


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model computes with: parameters, buffers and tensors kept as plain attributes (the int4
    layers' packed codes); oneDNN's opaque packed copies are skipped (their source weights are parameters)."""
    tensors = []
    for module in model.modules():
        for value in list(module._parameters.values()) + list(module._buffers.values()) + list(vars(module).values()):
            if isinstance(value, torch.Tensor) and not value.is_mkldnn and value.layout == torch.strided:
                tensors.append(value)
    return tensors


def step_buckets(block_size: int) -> tuple[int, ...]:
    """Token counts with a graph of their own: powers of two up to a block (a verify of `block_size` tokens)."""
    buckets = [1]
    while buckets[-1] < block_size:
        buckets.append(min(2 * buckets[-1], block_size))
    return tuple(buckets)


def batch_ranges(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Batch sizes of the 1-token batched graphs: 2 up to a quantized target's kernel rows (past them, and for a
    dense target, the blocks' graph takes plain steps too: its linears multiply by the dense copies)."""
    limit = kernel_rows(model)
    return ((2, limit),) if limit is not None and limit >= 2 else ()


def compile_refusal(model: nn.Module, device: str) -> str | None:
    """Why `model` on `device` cannot run compiled steps (None: it can)."""
    if device != "cpu":
        return "compiled steps are built for CPUs only (CUDA graphs are not built yet)"
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or any(hasattr(layer, "linear_attn") for layer in model.model.layers):
        return f"compiled steps need full-attention layers only (this target has {sorted(types)})"
    return None


def wants_compile(choice: str, model: nn.Module, device: str) -> bool:
    """What `choice` ("auto", "on", "off") means for `model` on `device`. "auto": on for an int4 target on a CPU
    (docs/journal/2026-12-05-compiled-steps.md); "on" where it cannot be built raises ConfigError."""
    from ..config import ConfigError

    if choice == "off":
        return False
    refusal = compile_refusal(model, device)
    if choice == "on" and refusal is not None:
        raise ConfigError(f"compile: {refusal}")
    return refusal is None and (choice == "on" or serves_int4(model))


def compiled_step_for(model: nn.Module, choice: str, device: str, layers: tuple[int, ...], block_size: int,
                      cache_dir: Path, attention=None, owner: str = "target", threads: int = 1,
                      batched: bool = False, chunk_tokens: tuple[int, int] = (0, 0)) -> CompiledStep | None:
    """The built `CompiledStep` for `model` as `choice` wants (None: eager), for forwards of up to `threads`
    threads (`batched`: with the batched graphs of plain steps under load; `chunk_tokens`: with the prompt-chunk
    graph of that range of tokens). A build that fails logs why and leaves the forwards eager: a compiler problem
    never stops the worker."""
    if not wants_compile(choice, model, device):
        return None
    step = CompiledStep(model, layers, step_buckets(block_size), cache_dir, autotune=serves_int4(model),
                        attention=attention, threads=threads, batch_ranges=batch_ranges(model) if batched else (),
                        block_tokens=block_size if batched else 0, chunk_tokens=chunk_tokens)
    if not built(step, owner, "the steps"):
        return None
    log.info("%s: steps of %s tokens, prompt chunks of %s and batched steps (tokens x requests) of %s compiled for "
             "up to %d threads (%.1f s compiling, %d of %d loaded from %s)", owner, "/".join(map(str, step.buckets)),
             step.chunk_shape.name if step.chunk_shape in step.graphs else "none",
             ", ".join(shape.name for shape in step.graphs if shape.batched) or "none",
             threads, step.compile_s, step.loaded, len(step.shapes), cache_dir)
    return step
