"""Linear layers served from 4-bit weights with torch's int4 weight-only CPU kernel.

`torch._weight_int4pack_mm_for_cpu` multiplies activations by a weight packed two codes to a byte, with one
scale and one zero point per group of 32 inputs: w = scale * (q - 8) + zero. GGUF's Q4_1 (w = d * q + m)
maps onto it with scale = d and zero = m + 8 d; the scale and zero are kept in the activations' dtype (the
kernel's requirement), so in bf16 they round d and m + 8 d to 8 significant bits: the weights served are
those, not the file's fp16 values (docs/numerics.md, "The int4 target").

The kernel streams a quarter of a bf16 weight's bytes, which is what a decoding step is bound by, but it is
not a GEMM: measured on a 2-core AMD EPYC with avx512_bf16, 1 thread, the 210 linears of SmolLM2-135M
against prepacked bf16 (oneDNN): 2.5x faster at 1 row, 1.9x at 4, 1.2x at 8, 0.8x at 16, 0.5x at 64
(`scripts/weight_only.py 1`; 2 threads: 3.1x, 2.3x, 1.7x, 1.0x, 0.6x). So a forward over more than
`INT4_MAX_ROWS` rows multiplies by a dense copy of the same weights (models/weight_only.py). With fp32
activations the kernel takes a slow reference path (25x slower than fp32 oneDNN at 1 row): int4 is only
chosen automatically for bf16.
"""
from __future__ import annotations

import torch
from torch import nn

from .gguf_weights import BLOCK, Q4Weight
from .weight_only import WeightOnlyLinear

INT4_MAX_ROWS = 8  # rows up to which the int4 kernel is faster than the dense copy (measured above)
INNER_K_TILES = 1  # unused by the CPU packing, kept at the value torch's own int4 CPU path passes


class Int4Linear(WeightOnlyLinear):
    """`x @ w.T + bias` with w a `Q4Weight`, served by the int4 kernel for a few rows and a dense copy else."""

    max_rows = INT4_MAX_ROWS
    label = f"int4 group {BLOCK}"

    def __init__(self, weight: Q4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(*weight.shape, bias, dtype)
        scale_zero = torch.stack([weight.d, weight.m + 8 * weight.d], dim=-1)  # [out, groups, 2]
        self.scale_zero = scale_zero.transpose(0, 1).contiguous().to(dtype)  # [groups, out, 2]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), INNER_K_TILES)
        self.keep_dense(self.served_weight(weight.codes), dtype)

    def served_weight(self, codes: torch.Tensor) -> torch.Tensor:
        """[out, in] float32: the weight the kernel multiplies by, scale * (q - 8) + zero."""
        scale, zero = self.scale_zero.float().transpose(0, 1).unbind(-1)  # [out, groups] each
        return (scale.repeat_interleave(BLOCK, 1) * (codes.float() - 8)
                + zero.repeat_interleave(BLOCK, 1))

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, BLOCK, self.scale_zero)


def serves_int4(model: nn.Module) -> bool:
    """Whether any of `model`'s linears is served from 4-bit weights."""
    return any(isinstance(module, Int4Linear) for module in model.modules())
