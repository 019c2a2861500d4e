"""What the weight-only quantized linears (int4, int8) share: a kernel for a few rows, a dense copy beyond.

torch's weight-only kernels stream fewer weight bytes per product, which is what a decoding step of a few rows is
bound by, but they are not GEMMs: past a few rows oneDNN's prepacked dense product wins (each subclass measures
its own crossover, `max_rows`). So a forward over more rows (batched steps of many requests, prompt chunks)
multiplies by a dense copy of the *same* weights the kernel serves, prepacked for oneDNN where it can be. Both
paths thus serve one set of weights and differ in rounding only: int4's copy holds the weights rounded to the
activations' dtype; int8's holds the codes (exact in bf16) and scales the product per channel afterwards, as
the kernel does.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .cpu_linear import PACK_FOR_ROWS, prepacking_available


class WeightOnlyLinear(nn.Module):
    """`x @ w.T + bias` with w quantized: `kernel` for up to `max_rows` rows, the dense copy else."""

    max_rows = 0  # rows up to which the subclass's kernel is faster than the dense copy
    label = ""  # "int4", "int8": what the kernel serves
    dense_only = False  # set by `dense_products` (while tracing a graph whose row count is symbolic)

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.detach().to(dtype)

    def keep_dense(self, served: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep `served` ([out, in] float32: the weights the kernel multiplies by, or a subclass's exact factor of
        them) as the dense copy in `dtype`. Only the packed copy is kept where oneDNN can pack (no plain weight:
        nothing else reads it)."""
        dense = served.to(dtype)
        self.dense_packed = prepacking_available(dtype)
        self.dense = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_FOR_ROWS) if self.dense_packed else dense

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [rows, in] contiguous -> [rows, out], without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]"""
        rows = x.reshape(-1, self.in_features)  # [rows, in]
        if WeightOnlyLinear.dense_only or rows.shape[0] > self.max_rows or rows.shape[0] == 0:
            return self.dense_forward(x)
        out = self.kernel(rows.contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] through the dense copy."""
        return self.dense_product(x, self.bias)

    def dense_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]: x @ dense.T + bias."""
        if self.dense_packed:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.dense, bias, "none", [], "")
        return nn.functional.linear(x, self.dense, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.label}"


@contextmanager
def dense_products():
    """Every weight-only linear takes its dense copy within the block, whatever its rows: how a graph is traced
    whose rows (requests x tokens) are symbolic, so that the tracer never decides the path by the rows. Its
    callers feed such a graph more than `kernel_rows` rows, where the eager forward takes the same path."""
    WeightOnlyLinear.dense_only = True
    try:
        yield
    finally:
        WeightOnlyLinear.dense_only = False


def weight_only_layers(model: nn.Module) -> list[WeightOnlyLinear]:
    return [module for module in model.modules() if isinstance(module, WeightOnlyLinear)]


def kernel_rows(model: nn.Module) -> int | None:
    """Rows up to which `model`'s quantized linears take their kernel (None: no quantized linear). One model
    holds one kind, so one limit."""
    limits = {layer.max_rows for layer in weight_only_layers(model)}
    return max(limits) if limits else None
