"""Linear layers served from 8-bit weights with torch's int8 weight-only CPU kernel (`--quantization int8`).

`torch._weight_int8pack_mm` multiplies activations by an int8 weight [out, in] with one scale per output
channel: w = scale * q, q in -127..127. The weights are quantized at load from the model's dense weights,
symmetric per channel (scale = max |w| / 127, the scale kept in the activations' dtype as the kernel requires):
closer to the dense model than 4-bit groups, half a bf16 weight's bytes. A GGUF's Q8_0 (one scale per 32
inputs) has no matching CPU kernel in torch; a Q8_0 or Q4 file's weights are re-quantized from their
dequantized values, so int8 serves other numbers than the file.

The kernel beats oneDNN's prepacked dense product at 1 and 2 rows only (`scripts/weight_only.py`; the runs in
docs/journal/2026-12-06-int8-weights.md), so it takes forwards of up to `INT8_MAX_ROWS` rows and the dense copy
the rest (models/weight_only.py).
"""
from __future__ import annotations

import torch

from .weight_only import WeightOnlyLinear

INT8_MAX_ROWS = 2
INT8_LEVELS = 127  # symmetric: q in -127..127 (-128 unused, so -w quantizes to -q)


class Int8Linear(WeightOnlyLinear):
    """`x @ w.T + bias`, w = scale * q per output channel, on the int8 kernel for a few rows."""

    max_rows = INT8_MAX_ROWS
    label = "int8 per channel"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        out_features, in_features = weight.shape
        super().__init__(out_features, in_features, bias, dtype)
        dense = weight.detach().float()  # [out, in]
        scale = dense.abs().amax(dim=1) / INT8_LEVELS  # [out]
        scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(dtype)  # the kernel's (rounded) scale
        self.scale = scale
        self.codes = torch.round(dense / scale.float()[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        # The dense copy holds the codes, exact in bf16 (|q| <= 127 needs 7 bits), and the product is scaled per
        # channel afterwards, as the kernel scales its fp32 sums: rounding scale * q to bf16 instead moved the
        # logits enough to flip 8 of 12 near-tie chat outputs between a 1-token step and a verify block.
        self.keep_dense(self.codes.float(), dtype)

    def served_weight(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernel multiplies by, scale * q."""
        return self.codes.float() * self.scale.float()[:, None]

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.codes, self.scale)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: (x @ q.T) * scale + bias."""
        out = self.dense_product(x, None) * self.scale  # [..., out]
        return out if self.bias is None else out + self.bias
