"""`--quantization`: which weights a model's linear layers are served from.

- `none`: the dense weights of the model folder (a GGUF target: dequantized once at conversion).
- `int4`: 4-bit weights in groups of 32 served by torch's int4 kernel (models/int4_linear.py). A target
  converted from a GGUF keeps the file's own Q4_0/Q4_1 weights (other tensors, e.g. a Q8_0 embedding / LM
  head, stay dense); any other target is quantized at load, Q4_1-style, every linear of its decoder layers.
- `auto`: `int4` where it is the model as it ships and where it is fast: a target with 4-bit weights in its
  GGUF, on a CPU, in bf16 (the kernel's fast path); else `none`.
- `int8`: 8-bit weights with one scale per output channel, quantized at load from the model's dense weights
  (models/int8_linear.py), every linear of its decoder layers: half the bytes of bf16, closer to the dense
  model than 4-bit groups. Never chosen by `auto`: no shipped file of ours holds weights in that form.

Only the CPU kernels are wired: int4 or int8 on a GPU device is refused, not run dequantized behind the user's
back.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError
from .gguf_weights import BLOCK, Q4Weight, q4_tensor_count, read_q4_weights
from .int4_linear import Int4Linear
from .int8_linear import Int8Linear

log = logging.getLogger("foresight.quantization")


def apply_quantization(model: nn.Module, choice: str, path: Path, device: str, owner: str) -> str:
    """Serve the linears of `model` (loaded from the folder `path` onto `device`) as `choice` (auto | none |
    int4 | int8) says; what it resolved to."""
    from .loading import gguf_source

    gguf = gguf_source(path)
    dtype = next(model.parameters()).dtype
    resolved = resolve_quantization(choice, gguf, dtype, device)
    if choice == "auto":
        log.info("%s: quantization auto -> %s (%s, %s, %s)", owner, resolved, device, dtype,
                 f"GGUF {gguf.name}" if gguf is not None else "no GGUF source")
    quantize_model(model, resolved, gguf, owner)
    return resolved


def resolve_quantization(choice: str, gguf: Path | None, dtype: torch.dtype, device: str) -> str:
    """What `choice` (auto | none | int4 | int8) means for a model of `dtype` on `device` whose GGUF source is
    `gguf`."""
    if choice in ("int4", "int8") and not device.startswith("cpu"):
        raise ConfigError(f"quantization: {choice} runs on CPU devices only for now (got device {device!r}); "
                          "use --quantization none")
    if choice != "auto":
        return choice
    if not device.startswith("cpu") or dtype != torch.bfloat16 or gguf is None:
        return "none"
    return "int4" if q4_tensor_count(gguf) else "none"


def quantize_model(model: nn.Module, choice: str, gguf: Path | None, owner: str) -> int:
    """Serve `model`'s linears as `choice` says ("none", "int4" or "int8", already resolved); the number
    replaced. int4: with a GGUF source holding 4-bit weights they are used as they are; else (and for int8
    always) the decoder layers' linears are quantized here."""
    if choice == "none":
        return 0
    if choice == "int8":
        return quantize_int8(model, owner)
    start = time.perf_counter()
    weights = read_q4_weights(gguf, model) if gguf is not None else {}
    source = f"the 4-bit weights of {gguf.name}" if weights else "weights quantized at load"
    weights = weights or quantize_decoder_linears(model)
    dtype = next(model.parameters()).dtype
    replace_modules(model, list(weights), lambda name, linear: Int4Linear(weights[name], linear.bias, dtype))
    log.info("%s: %d linear layers served in int4 from %s (%.1f s)", owner, len(weights), source,
             time.perf_counter() - start)
    return len(weights)


def quantize_int8(model: nn.Module, owner: str) -> int:
    """Serve every linear of `model`'s decoder layers as an `Int8Linear`; the number replaced."""
    start = time.perf_counter()
    dtype = next(model.parameters()).dtype
    names = list(decoder_linears(model))
    replace_modules(model, names, lambda name, linear: Int8Linear(linear.weight, linear.bias, dtype))
    log.info("%s: %d linear layers served in int8, quantized at load (%.1f s)", owner, len(names),
             time.perf_counter() - start)
    return len(names)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every `nn.Linear` inside the decoder layers (`model.model.layers`; embeddings and LM head stay), by name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and ".layers." in name}


def replace_modules(model: nn.Module, names: list[str], make: Callable[[str, nn.Module], nn.Module]) -> None:
    """Replace each submodule of `model` named in `names` by `make(name, the submodule)`, one at a time (a dense
    weight can go as soon as its replacement is in), then hand the memory they held back to the OS."""
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, make(name, getattr(owner, leaf)))
    release_freed_memory()


def release_freed_memory() -> None:
    """Hand the replaced dense weights' memory back to the OS. glibc keeps freed heap memory mapped (after
    a 200 MB weight swap the worker's RSS stayed 265 MB above the dense target's); elsewhere a no-op."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def quantize_decoder_linears(model: nn.Module) -> dict[str, Q4Weight]:
    """Q4_1 of every decoder linear (`decoder_linears`) whose inputs come in whole blocks."""
    return {name: Q4Weight.quantize(linear.weight) for name, linear in decoder_linears(model).items()
            if linear.in_features % BLOCK == 0}
