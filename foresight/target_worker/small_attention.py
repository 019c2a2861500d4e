"""Attention for a few query positions in bf16/fp16 on a CPU, as two matmuls in float32.

Decoding feeds one position per request (a verify block, a handful); the keys are the whole context. On a
CPU, PyTorch's SDPA in bf16 runs its flash kernel, which for such short queries is several times slower than
the same attention written as `softmax(q k^T) v` in float32: measured on a 2-core AMD EPYC with avx512_bf16
(torch 2.13, SmolLM2-135M's 9 query / 3 key-value heads of 64, ~260 keys, transformers' SDPA call), 8 requests
of 2 or 4 positions took 2.1-3.6 ms with SDPA against 0.34-0.64 ms, 8 requests of 1 position 0.30-0.55
against 0.30-0.41 ms; one request's 16 positions were slower (0.70-0.87x). In float32 SDPA is as fast, so fp32
models keep it, as do long queries (prompt chunks), where the flash kernel pays.

Results differ from SDPA's by rounding only: both accumulate in float32; SDPA's kernel rounds its blocks
differently (largest difference 2e-3 in bf16 outputs, the size of one bf16 step).
"""
from __future__ import annotations

import torch

# Query positions up to which the matmul form is used: several requests' rows (a batched step) or one
# request's. Measured through whole forwards (2 threads, bf16): a 1-token step 1.10x, 8 requests of 1 and of
# 4 positions 1.09x and 1.10x, one 8-position verify 0.96x (0.86x in a second run), so one request's longer
# blocks and prompt chunks keep SDPA.
SMALL_QUERY = 8
SMALL_QUERY_ALONE = 4
LOW_PRECISION = (torch.bfloat16, torch.float16)
UNSUPPORTED = ("position_bias", "softcap", "s_aux", "sinks")  # extras only SDPA's own path applies


def takes_matmul_path(query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `matmul_attention` computes this call: a CPU, bf16/fp16, a short query, and a mask shared by
    the heads given (or a single position, which needs none), nothing else to apply."""
    small = SMALL_QUERY if query.shape[0] > 1 else SMALL_QUERY_ALONE
    masked = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    return (query.device.type == "cpu" and query.dtype in LOW_PRECISION and query.shape[2] <= small
            and (masked or (attention_mask is None and query.shape[2] == 1))
            and not kwargs.get("dropout") and all(kwargs.get(k) is None for k in UNSUPPORTED))


def matmul_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, heads, Lq, D], key/value [B, kv_heads, L, D],
    attention_mask bool [B or 1, 1, Lq, L] (True: attend) or additive float, or None for Lq = 1
    -> ([B, Lq, heads, D], None). Query head h reads key-value head h // (heads / kv_heads), as repeat_kv."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(batch, kv_heads, groups * length, dim).float()  # [B, kv_heads, G * Lq, D]
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [B, kv_heads, G * Lq, L]
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, groups, length, -1)  # [B, kv_heads, G, Lq, L]
        mask = attention_mask[:, :, None]  # [B or 1, 1, 1, Lq, L]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
        scores = scores.view(batch, kv_heads, groups * length, -1)
    probs = torch.softmax(scores, dim=-1)  # [B, kv_heads, G * Lq, L]
    out = torch.matmul(probs, value.float())  # [B, kv_heads, G * Lq, D]
    out = out.view(batch, heads, length, dim).transpose(1, 2)  # [B, Lq, heads, D]
    return out.to(query.dtype).contiguous(), None
