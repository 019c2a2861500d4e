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
with o_v >= o_u - E_u - E_v is then recomputed in fp32 (`Fp32LogitHead.refine_normed` with that window). The fp32
argmax v* is among them (o_v* >= l_v* - E_v* >= l_u - E_v* >= o_u - E_u - E_v*), and every entry left out lies below
u's fp32 logit (o_v < o_u - E_u <= l_u), so the refined row's argmax is the fp32 head's. The other entries are up to
E_v off: rows whose sampling, logit rules, grammar or logprobs read them never come here
(`TargetRunner.verify(argmax_only=...)`).
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

    def logits(self, low: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """low [1, hidden] (the model's own final-norm output, serving dtype), normed [1, hidden] (the fp32 one) ->
        (logits [1, vocab] in the serving dtype, their bounds E_v [1, vocab])."""
        out = torch._weight_int8pack_mm(low.contiguous(), self.codes, self.scales)  # [1, vocab]
        x = low.float()
        rounding = (normed - x).abs().sum() + ACCUMULATION * x.abs().sum()
        bounds = self.code_error * normed.abs().sum() + self.weight_max * rounding + OUTPUT_ROUNDING * out.float().abs()
        return out, bounds

    @staticmethod
    def window(logits: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """How far below its row's maximum each entry of `logits` [1, vocab] is recomputed in fp32: E_u + E_v."""
        return bounds + bounds.gather(-1, logits.argmax(-1, keepdim=True))


def argmax_head_for(head, device: torch.device) -> ArgmaxHead | None:
    """An `ArgmaxHead` for a runner's fp32 logit head (`Fp32LogitHead`, None without one) on a CPU, where the int8
    kernel runs; None elsewhere."""
    if head is None or device.type != "cpu":
        return None
    return ArgmaxHead(head.weight_low)
