"""An int8 copy of a low-precision target's LM head, for rows decided by their argmax alone (`ArgmaxHead`).

A plain step of one greedy request reads the whole [vocab, hidden] head once for one row: on the embedded default in
bf16 that is 57 MB, about as many bytes as all its int4 decoder layers. Those rows need
only the argmax of the fp32 head's logits (logit_head.py: the model's head, then every entry near the row's maximum
recomputed in fp32). This head stores the weight as int8 codes with one scale per vocabulary row (half the bytes;
`torch._weight_int8pack_mm`) and bounds, for each row it computes, how far each of its logits can lie from the fp32
head's:

    fp32 logit l_v = sum_i w_vi h_i   (w: the head's weight as served, upcast; h: the fp32 final-norm output)
    int8 logit o_v = bf16(s_v sum_i q_vi x_i)   (q, s: the codes and stored scales; x: the model's own norm output)
    |l_v - o_v| <= E_v = c_v ||h||_1 + m_v (||h - x||_1 + 1e-4 ||x||_1) + |o_v| 2^-8

(c_v = max_i |w_vi - q_vi s_v| and m_v = max_i |q_vi s_v|, per vocabulary row, measured once; the 1e-4 covers the
kernel's fp32 accumulation of hidden-size products, the 2^-8 its bf16 output). With u the int8 argmax, every entry v
with o_v >= o_u - E_u - E_v is recomputed in fp32 (`Fp32LogitHead.exact_columns`). The fp32 argmax v* is among them
(o_v* >= l_v* - E_v* >= l_u - E_v* >= o_u - E_u - E_v*), and every entry left out lies below u's fp32 logit
(o_v < o_u - E_u <= l_u), so the refined row's argmax is the fp32 head's. The entries are found in two passes: those
within E_u plus the largest E_v of the head, then each of those against its own E_v. The other entries are up to E_v
off: rows whose sampling, logit rules, grammar or logprobs read them never come here
(`TargetRunner.verify(argmax_only=...)`), nor do targets with a final logit soft-cap (it would apply to the refined
entries only).
"""
from __future__ import annotations

import torch

OUTPUT_ROUNDING = 2.0 ** -8  # relative error of a bf16 (or fp16) output, with a factor 2 of margin
ACCUMULATION = 1e-4  # the kernel's fp32 sums of hidden-size products, relative to weight_max ||x||_1 (generous)


class ArgmaxHead:
    """The LM head `weight` [vocab, hidden] (the serving dtype) as int8 codes and per-row scales, with the per-row
    constants of its error bound."""

    def __init__(self, weight: torch.Tensor):
        exact = weight.detach().float()  # [vocab, hidden]
        scales = (exact.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [vocab]
        self.codes = torch.round(exact / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(weight.dtype)  # [vocab], as the kernel reads them
        decoded = self.codes.float() * self.scales.float()[:, None]  # what the kernel multiplies by
        self.code_error = (exact - decoded).abs().amax(1)  # [vocab] c_v
        self.weight_max = decoded.abs().amax(1)  # [vocab] m_v
        self.code_error_max, self.weight_max_max = self.code_error.max(), self.weight_max.max()

    def logits(self, low: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """low [1, hidden] (the model's own final-norm output, serving dtype), normed [1, hidden] (the fp32 one) ->
        (logits [1, vocab] float32, the columns [1, k] to recompute in fp32 for the argmax to be the fp32 head's)."""
        out = torch._weight_int8pack_mm(low.contiguous(), self.codes, self.scales).float()  # [1, vocab]
        norm_sum, rounding = self._sums(low, normed)
        top, u = out[0].max(0)
        smallest = out[0].min()
        loosest = self.code_error_max * norm_sum + self.weight_max_max * rounding \
            + OUTPUT_ROUNDING * torch.maximum(top.abs(), smallest.abs())  # >= every E_v
        e_u = self.code_error[u] * norm_sum + self.weight_max[u] * rounding + OUTPUT_ROUNDING * top.abs()
        near = (out[0] >= top - e_u - loosest).nonzero()[:, 0]  # [n] every column that may qualify
        e_near = self.code_error[near] * norm_sum + self.weight_max[near] * rounding \
            + OUTPUT_ROUNDING * out[0, near].abs()
        return out, near[out[0, near] >= top - e_u - e_near][None]

    def bounds(self, logits: torch.Tensor, low: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """E_v of every entry of `logits` [1, vocab] (`logits`' first output, from these `low` and `normed`)."""
        norm_sum, rounding = self._sums(low, normed)
        return self.code_error * norm_sum + self.weight_max * rounding + OUTPUT_ROUNDING * logits.abs()

    @staticmethod
    def _sums(low: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(||h||_1, ||h - x||_1 + 1e-4 ||x||_1) of the bound."""
        x = low.float()
        return normed.abs().sum(), (normed - x).abs().sum() + ACCUMULATION * x.abs().sum()


def argmax_head_for(head, device: torch.device) -> ArgmaxHead | None:
    """An `ArgmaxHead` for a runner's fp32 logit head (`Fp32LogitHead`, None without one) on a CPU, where the int8
    kernel runs, for a target without a final logit soft-cap; None elsewhere."""
    if head is None or device.type != "cpu" or head.softcap:
        return None
    return ArgmaxHead(head.weight_low)
