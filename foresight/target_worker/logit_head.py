"""Target logits in fp32 for a target served in bf16/fp16.

A bf16 LM head rounds every logit to 8 significant bits: at the magnitude of SmolLM2's logits (~15-30)
that is a step of 0.0625-0.125, so two candidate tokens often get *exactly* the same logit, and which
of them wins the argmax then depends on how the last hidden state was rounded -- which differs between
a 1-token step and a γ+1-token verify forward. Greedy speculative output then drifts from plain
greedy decoding at ties that are artefacts of the output format, not of the model.

`Fp32LogitHead` keeps the body of the model in its serving dtype and computes only the last mile in
fp32: the final norm (a float copy of the norm module, so any RMSNorm variant is reproduced) over the
last layer's output, then the LM head with an fp32 copy of its weight, then the model's final logit
soft-capping where it has one (Gemma). The copy costs vocab x hidden x 4 bytes (113 MB for SmolLM2), made only
where every logit is computed in fp32 ("fp32"); upcasting the bf16 weight on every call measured 6x slower
(docs/numerics.md). "fp32-top" recomputes only a few entries, from the serving-dtype weight's rows.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


# How the target's logits are computed when it runs in bf16/fp16: "model" (its own head, low precision),
# "fp32" (final norm + LM head in fp32), "fp32-top" (its own head, then the near-maximum entries in fp32).
LOGIT_PRECISIONS = ("model", "fp32", "fp32-top")
# Positions of a batched forward, as (row indices [n], position indices [n]).
Selection = tuple[torch.Tensor, torch.Tensor]


class Fp32LogitHead:
    """fp32 logits from the pre-norm output of the last decoder layer of a low-precision model."""

    def __init__(self, model: nn.Module):
        base = model.model
        self.norm = copy.deepcopy(base.norm).float()
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("Fp32LogitHead: LM heads with a bias are not supported")
        self.weight_low = whole(head.weight.detach())  # [vocab, hidden] in the serving dtype
        self._weight: torch.Tensor | None = None  # `weight`, made at its first use
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        # Measured on SmolLM2 in bf16: |model logit - fp32 logit| <= 0.005 x |row max| over the top-50
        # tokens (0.22 at |max| 46) = 0.6 eps. Refining everything within 8 eps x |row max| of the
        # maximum (2.9 at 46) leaves a margin of > 6x over twice that error.
        self.window_rel = 8 * torch.finfo(self.weight_low.dtype).eps
        self._captured: torch.Tensor | None = None
        # The final norm's input is the last layer's output: capture it as the base model runs.
        base.norm.register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        self.capture(args[0])

    def capture(self, last: torch.Tensor) -> None:
        """last [batch, positions, hidden]: the last layer's output, which the next logits are computed from
        (a forward that does not run the model's final norm hands it over here)."""
        self._captured = last

    def logits(self, keep: int, select: Selection | None = None) -> torch.Tensor:
        """[keep, vocab] float32 logits for the last `keep` positions of the forward that just ran
        (of a batched forward: the positions `select` names)."""
        logits = torch.nn.functional.linear(self.normed(keep, select), self.weight)
        return self._softcap(logits)

    @property
    def weight(self) -> torch.Tensor:
        """[vocab, hidden] float32: the LM head's fp32 copy (made once, where every logit is computed in fp32)."""
        if self._weight is None:
            self._weight = self.weight_low.float()
        return self._weight

    def refine(self, low: torch.Tensor, select: Selection | None = None) -> torch.Tensor:
        """fp32 logits where they decide: `low` [keep, vocab] (the model's own low-precision logits)
        upcast, with every token whose low-precision logit lies within a window of its row's maximum
        recomputed in fp32 from its own weight row. The argmax then equals the full fp32 head's
        whenever the window exceeds twice the low-precision rounding error; other entries keep their
        low-precision values."""
        return self.refine_normed(low, self.normed(low.shape[0], select))

    def refine_normed(self, low: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """`refine` given the final norm's fp32 output for those rows, normed [keep, hidden] (`normed`)."""
        out = low.float()
        top = out.max(-1, keepdim=True).values  # [keep, 1]
        return self._exact_at(out, out >= top - self.window_rel * top.abs(), normed)

    def refine_ruled(self, logits: torch.Tensor, normed: torch.Tensor, rules) -> torch.Tensor:
        """`rules(logits)` (a request's logit rules: elementwise, row by row) where the rules moved the maximum:
        the tokens near each ruled row's maximum are recomputed in fp32 before the rules apply, so a token the
        rules lifted from far below the unruled maximum is not decided on its low-precision logit. The window
        is taken at the larger of the two maxima's scales, doubled (a repetition penalty of up to 2 scales a
        logit's rounding error by as much). logits [keep, vocab] float32 (`refine`'s), normed [keep, hidden]."""
        ruled = rules(logits)
        top = ruled.max(-1, keepdim=True).values  # [keep, 1]
        scale = torch.maximum(top.abs(), logits.max(-1, keepdim=True).values.abs())
        return rules(self._exact_at(logits.clone(), ruled >= top - 2 * self.window_rel * scale, normed))

    def exact_columns(self, logits: torch.Tensor, columns: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """A copy of logits [n, vocab] float32 with the entries of `columns` [n, c] (token ids per row) recomputed
        in fp32 from normed [n, hidden] (the final norm's fp32 output of those rows)."""
        rows = torch.arange(columns.shape[0], device=logits.device).repeat_interleave(columns.shape[1])  # [n * c]
        # A column named twice is written twice with the same value.
        return self._write_exact(logits.clone(), rows, columns.reshape(-1), normed)

    def _exact_at(self, out: torch.Tensor, where: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """out [keep, vocab] with the entries `where` [keep, vocab] bool recomputed in fp32 (in place)."""
        return self._write_exact(out, *where.nonzero(as_tuple=True), normed)

    def _write_exact(self, out: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """out [keep, vocab] with the entries (rows [m], cols [m]) recomputed in fp32 (in place)."""
        exact = (self.weight_low[cols].float() * normed[rows]).sum(-1)  # [m]
        out[rows, cols] = self._softcap(exact)
        return out

    def normed(self, keep: int, select: Selection | None = None) -> torch.Tensor:
        """[keep, hidden] float32: the final norm (in fp32) of the last `keep` captured positions (of a batched
        forward: the positions `select` names)."""
        captured = self._captured  # [batch, positions, hidden]
        hidden = (captured[select] if select is not None else captured[0, -keep:]).float()  # [keep, hidden]
        self._captured = None
        return self.norm(hidden)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        return soft_cap(logits, self.softcap)


def whole(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as one plain tensor: a tensor-parallel target's shards (a DTensor) gathered on every rank."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """A model's final logit soft-capping (Gemma's `final_logit_softcapping`); None or 0: none."""
    return torch.tanh(logits / cap) * cap if cap else logits


def needs_fp32_head(model: nn.Module) -> bool:
    """True when the model computes in a dtype narrower than fp32 and has the usual `model.model.norm`."""
    dtype = next(model.parameters()).dtype
    base = getattr(model, "model", None)
    return dtype in (torch.bfloat16, torch.float16) and base is not None and hasattr(base, "norm")
