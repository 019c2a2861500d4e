"""Linear layers whose weights are prepacked for oneDNN: faster CPU inference at the row counts serving uses.

On a CPU, `nn.Linear` calls the BLAS on the plain [out, in] weight, which it re-blocks on every call; from
2 rows on it measured as slow as 2 one-row products on this project's AVX2 machines. oneDNN can pack a
weight once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what PyTorch's inductor
does for CPU linears) and multiply from it (`torch.ops.mkldnn._linear_pointwise`). Measured on SmolLM2-135M in
fp32 on 2 threads of an AMD EPYC without AVX-512 (`scripts/cpu_linear.py`; docs/journal/2026-12-03-prepacked-linears.md):
1.2x on a 1-token step, 1.3-1.7x on an 8-position verify or an 8-request step. Results differ from
`nn.Linear` by float rounding only (another summation order, ~1e-5 relative). In bf16 on a 2-core AMD EPYC
with avx512_bf16, 1 thread: 1.40x on a 1-token step, 1.51x on an 8-position verify, 1.34x on an 8-request step,
1.22x on a 60-token prefill, with logits identical to `nn.Linear`'s.

`PrepackedLinear` keeps the module's own `weight` (tied embeddings and the fp32 logit head read it) and
multiplies with the packed copy; it falls back to `nn.Linear`'s product wherever autograd records, and
while a compiler traces it (oneDNN's opaque packed tensor cannot be traced; inductor prepacks on its own).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..config import CPU_LINEARS
from .loading import cpu_supports_bf16

log = logging.getLogger("foresight.cpu_linear")

PACK_FOR_ROWS = 8  # oneDNN's layout hint: measured as fast as or faster than a 1-row layout at 1..68 rows


class PrepackedLinear(nn.Module):
    """`linear` with its weight prepacked for oneDNN (CPU, inference)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], shared: tied embeddings keep reading it
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]"""
        traced = torch.compiler.is_compiling()  # a compiler prepacks the plain weight on its own
        if traced or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepacking_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can prepack weights of `dtype` for oneDNN on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return dtype in (torch.float32, torch.bfloat16)


def prepack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (on the CPU) by a `PrepackedLinear`; the number replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PrepackedLinear(child))
                replaced += 1
    return replaced


def auto_prepacks(dtype: torch.dtype) -> bool:
    """What `--cpu-linear auto` does for a model of `dtype`: prepack fp32, and bf16 where the CPU multiplies
    bf16 natively (where it emulates bf16, nothing was measured, and `--dtype auto` picks fp32 there)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_supports_bf16())


def use_cpu_linears(model: nn.Module, choice: str, device: str, owner: str) -> bool:
    """Apply `choice` ("auto": see `auto_prepacks`; "prepacked"; "plain") to `model`, loaded on `device` for
    `owner` (a name for the log). True when its linears were prepacked."""
    if choice not in CPU_LINEARS:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEARS}, got {choice!r}")
    dtype = next(model.parameters()).dtype
    wanted = choice == "prepacked" or (choice == "auto" and auto_prepacks(dtype))
    if device != "cpu" or choice == "plain" or not wanted:
        return False
    if not prepacking_available(dtype):
        log.warning("%s: oneDNN cannot prepack %s weights in this torch build or on this CPU: plain linears",
                    owner, dtype)
        return False
    count = prepack_linears(model)
    log.info("%s: %d linear layers prepacked for oneDNN (%s)", owner, count, dtype)
    return True
