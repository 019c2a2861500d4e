"""Attention for short queries on a CPU with the query heads of a key-value head folded into one SDPA call
(target_worker/small_attention.py): the same function as transformers' SDPA (1e-5 in fp32, bf16 rounding in
bf16), taken only where it was measured faster, and a target's forwards, single and batched, through it."""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from foresight.target_worker import packed_step, small_attention
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.small_attention import folded_attention, takes_folded_path
from support.tiny_models import tiny_model


class Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def inputs(batch, length, keys, dtype, mask_kind):
    torch.manual_seed(batch * 100 + length)
    q = torch.randn(batch, 9, length, 16, dtype=dtype)
    k, v = torch.randn(2, batch, 3, keys, 16, dtype=dtype)
    allowed = torch.arange(keys)[None, :] <= (keys - length + torch.arange(length))[:, None]  # [Lq, L] causal
    allowed = allowed[None, None].repeat(batch, 1, 1, 1)  # [B, 1, Lq, L]
    allowed[0, :, :, :3] = False  # a padded row
    if mask_kind == "none":
        return q, k, v, None
    if mask_kind == "bool":
        return q, k, v, allowed
    return q, k, v, torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).to(dtype)  # additive


@pytest.mark.parametrize("batch,length,mask_kind", [(1, 1, "none"), (1, 4, "bool"), (3, 1, "bool"),
                                                    (3, 5, "bool"), (2, 3, "float"), (1, 8, "bool")])
def test_it_is_sdpa_in_fp32_and_as_close_as_sdpa_in_bf16(batch, length, mask_kind):
    q, k, v, mask = inputs(batch, length, 40, torch.float32, mask_kind)
    reference = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.3)[0]  # [B, Lq, heads, D]
    got = folded_attention(Attn(), q, k, v, mask, scaling=0.3)[0]
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    low = [t.to(torch.bfloat16) if t is not None and t.is_floating_point() else t for t in (q, k, v, mask)]
    got_bf16 = folded_attention(Attn(), *low, scaling=0.3)[0]
    sdpa_bf16 = sdpa_attention_forward(Attn(), *low, scaling=0.3)[0]
    assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == reference.shape
    worst_sdpa = (sdpa_bf16.float() - reference).abs().max()
    assert (got_bf16.float() - reference).abs().max() <= max(2 * worst_sdpa, 1e-2)


def test_a_float32_mask_with_a_bf16_query_is_applied():
    q, k, v, mask = inputs(2, 3, 40, torch.float32, "float")  # the mask stays float32
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    got = folded_attention(Attn(), *low, mask, scaling=0.3)[0].float()
    reference = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.3)[0]
    assert (got - reference).abs().max() <= 3e-2


def test_it_is_taken_only_where_measured_faster():
    def query(batch, length, dtype=torch.bfloat16):
        return torch.zeros(batch, 9, length, 16, dtype=dtype)

    def mask(length=1):
        return torch.ones(1, 1, length, 1, dtype=torch.bool)
    per_head = torch.ones(1, 9, 1, 1, dtype=torch.bool)
    assert takes_folded_path(query(1, 1), None, {})  # a plain step needs no mask
    assert takes_folded_path(query(1, 8), mask(8), {}) and not takes_folded_path(query(1, 9), mask(9), {})
    assert takes_folded_path(query(8, 8), mask(8), {}) and not takes_folded_path(query(8, 9), mask(9), {})
    assert takes_folded_path(query(8, 4, torch.float32), mask(4), {})  # fp32 too: repeat_kv is the slow part
    assert not takes_folded_path(query(1, 4), None, {})  # causal by flag only: SDPA's own alignment
    assert not takes_folded_path(query(8, 4), mask(1), {})  # a mask broadcast over the queries: not folded
    assert not takes_folded_path(query(8, 1), per_head, {})  # a mask per head: not the shared one it expects
    assert not takes_folded_path(query(8, 1), mask(), {"softcap": 30.0})
    assert takes_folded_path(query(8, 1), mask(), {"sliding_window": 4, "dropout": 0.0})  # the mask has the window


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_a_targets_forwards_go_through_it(monkeypatch, dtype, tolerance):
    """Single and batched forwards of a target take the folded path, and their logits stay within float
    rounding of the same forwards with transformers' SDPA only."""
    model = tiny_model("llama").to(dtype)
    runner = TargetRunner(model)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return folded_attention(*args, **kwargs)

    def run():
        caches = [runner.new_cache() for _ in range(2)]
        runner.prefill(caches[0], [5, 6, 7, 8, 9, 10, 11, 12, 13])
        runner.prefill(caches[1], [20, 21, 22, 23, 24])
        single = runner.verify(caches[0], 14, [15, 16]).logits
        batched = [r.logits for r in runner.verify_batch(caches, [[17], [25, 26, 27]])]
        return [single, *batched]

    monkeypatch.setattr(packed_step, "folded_attention", counted)
    fast = run()
    assert calls and all(shape[2] <= small_attention.SMALL_QUERY for shape in calls)
    monkeypatch.setattr(packed_step, "takes_folded_path", lambda *a: False)
    calls.clear()
    plain = run()
    assert not calls
    for got, want in zip(fast, plain):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
