"""Attention for a few query positions on a CPU: the query heads that share a key-value head folded into
one SDPA call.

Decoding feeds a few positions per request (a plain step one, a verify block a handful); the keys are the
whole context. With a mask, transformers' SDPA call repeats every key-value head for its G query heads
(`repeat_kv`, a copy of the keys and values per layer) or, for one position, folds the G heads into G
query rows (`pack_gqa`). Folding works for any short query: head h = k * G + g of query position i becomes
row g * Lq + i of key-value head k, the mask's rows repeat G times, and one SDPA call reads each key once, in
the model's dtype. Measured on a 2-core AMD EPYC with avx512_bf16 (torch 2.13, SmolLM2-135M: 9 query / 3
key-value heads of 64, 250 keys, 30 layers with their own keys so they come from memory as in a forward,
2 threads, ms per forward's attention): bf16, 8 requests x 1 position 7.7 folded against 8.5 transformers'
SDPA and 9.6 the float32 matmuls this module used before; 8 x 4 10.0 / 39.0 / 13.0; 1 x 1 1.6 / 1.9 / 3.0;
1 x 8 3.3 / 5.3 / 6.9. fp32: 8 x 4 15.4 / 121 (repeat_kv) / 17.8; 1 x 4 (1 thread) 3.7 / 7.2 / 6.2; 8 x 1
even. Long queries (prompt chunks) keep transformers' SDPA; so do GPUs (not measured there).

Results differ from transformers' SDPA by rounding only (the same kernel, in another order of rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Query positions up to which the heads are folded per request's row (longer verify blocks and prompt chunks
# keep transformers' SDPA, whose flash kernel pays for long queries). Whole forwards,
# 2 threads, interleaved, against the float32 matmuls used before: bf16 1-token step 1.12x, 8 requests x 1
# 1.26x, x 4 1.07x, 16 x 1 1.08x; fp32 8 x 4 1.25x against transformers' SDPA, the rest even.
SMALL_QUERY = 8
UNSUPPORTED = ("position_bias", "softcap", "s_aux", "sinks")  # extras only SDPA's own path applies


def takes_folded_path(query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `folded_attention` computes this call: a CPU, a short query, and a mask shared by the heads
    given (or a single position, which needs none), nothing else to apply."""
    masked = (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
              and attention_mask.shape[2] == query.shape[2])
    return (query.device.type == "cpu" and query.shape[2] <= SMALL_QUERY
            and (masked or (attention_mask is None and query.shape[2] == 1))
            and not kwargs.get("dropout") and all(kwargs.get(k) is None for k in UNSUPPORTED))


def folded_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, heads, Lq, D], key/value [B, kv_heads, L, D],
    attention_mask bool [B or 1, 1, Lq, L] (True: attend) or additive float, or None for Lq = 1
    -> ([B, Lq, heads, D], None). The G = heads / kv_heads query heads that read one key-value head (head h
    reads h // G, as repeat_kv) become G x Lq query rows of that head: one SDPA call reads each key once."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * length, dim)  # [B, kv_heads, G * Lq, D], row g * Lq + i
    mask = attention_mask
    if mask is not None:
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        if length > 1 and groups > 1:
            mask = mask.repeat(1, 1, groups, 1)  # [B or 1, 1, G * Lq, L]: row g * Lq + i is query i's
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [B, kv_heads, G*Lq, D]
    if isinstance(length, int):  # eager, and graphs of a fixed query length
        return out.view(batch, heads, length, dim).transpose(1, 2).contiguous(), None
    # A graph traced with a symbolic query length cannot prove SDPA's output may be viewed as a whole: rows back to
    # heads by parts, [B, G * Lq, kv_heads, D] -> [B, G, Lq, kv_heads, D] -> [B, Lq, heads, D]
    out = out.transpose(1, 2).unflatten(1, (groups, length)).permute(0, 2, 3, 1, 4)
    return out.reshape(batch, length, heads, dim), None
