"""The adapter's loss on what the foresight decoder serves: KL from the target's next-token law.

At serving the foresight decoder (foresight/models/decoder.py) runs the target's top n layers (L-n..L-1),
its final norm and its LM head over the adapter's prediction at hidden-state index L-n, attending to keys/values
those layers made from the TRUE context states at L-n. The state loss of train_adapter.py (Smooth L1 + cosine)
weighs every direction of the residual stream alike; the top layers do not. With n = 3 on SmolLM2 (index 27 of
30) the prediction reaches a high cosine, yet the last few hundredths of error are what the LM head reads, and
the decoder's next token often differs from the target's. This loss trains on the decoder's output itself:

    KL = mean over block positions of  sum_{i in top-k}  p_i (log p_i - log q_i)

p: the target's stored law of the next token (labelled data `topk_logp`, log-softmax of its logits, top-k,
not renormalised; row t is the law of token t+1), q: the law the frozen top layers + norm + LM head give on
the predicted block states. Truncated to the stored top-k it is not a true KL (it can be slightly negative),
but its gradient in q is the full KL's restricted to the tokens that carry the target's mass.

`FrozenTop` computes q the way the decoder does: the layers take the true context states at L-n (positions
0..T-1, causal among themselves, without gradients) into a cache of keys/values -- exactly the target's --
then the predicted block states at the block's positions attend to it under the batch's mask (context before
the block's anchor, causal inside the block). The
target's weights are read, never trained: the layers run on detached copies of their parameters
(`torch.func.functional_call`, no memory copied), so gradients reach the prediction and nothing else, and the
target's own `requires_grad` flags are left alone -- an adapter copied from the target later (its stages are
deep copies of target layers, flags included; a 15-layer decoder runs layers the index-27 stage copies) stays
trainable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import functional_call
from transformers import DynamicCache

from ..models.decoder import SUPPORTED_MODEL_TYPES

if TYPE_CHECKING:
    from .train_adapter import AdapterBatch

__all__ = ["FrozenTop", "kl_loss"]


class FrozenTop:
    """The target's layers L-n..L-1 + final norm + LM head (shared with the target, never trained), scoring
    the adapter's predicted block states at index L-n (n = `n_layers`, the foresight decoder's depth)."""

    def __init__(self, target, n_layers: int | None, target_indices: list[int]):
        """n_layers: the decoder depth (the training setting `decoder_layers`); target_indices: the indices the
        adapter predicts, which must include the decoder's input L - n_layers."""
        if n_layers is None:
            raise ValueError("the KL loss needs decoder_layers: the depth of the decoder whose output it trains")
        config = target.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the KL loss runs the decoder's layers as a full-attention Llama-structured model "
                             f"{SUPPORTED_MODEL_TYPES}; got {model_type!r} (hybrid and sliding-window targets are "
                             f"not supported)")
        n_total = config.num_hidden_layers
        if not 1 <= n_layers <= n_total:
            raise ValueError(f"decoder_layers must lie in [1, {n_total}], got {n_layers}")
        self.input_index = n_total - n_layers  # hidden-state index the decoder reads (input of layer L-n)
        if self.input_index not in target_indices:
            raise ValueError(f"decoder_layers={n_layers} reads hidden-state index {self.input_index}; the adapter "
                             f"predicts {list(target_indices)}")
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n_total
        if any(layer_types[i] != "full_attention" for i in range(self.input_index, n_total)):
            raise ValueError(f"the KL loss needs full-attention layers {self.input_index}..{n_total - 1}, got "
                             f"{layer_types[self.input_index:]}")
        self.attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"the KL loss passes a 4-D attention mask: it needs sdpa or eager attention, the "
                             f"target uses {self.attn_implementation!r}")
        self.slot = list(target_indices).index(self.input_index)  # where index L-n lies in the adapter's states
        self.hidden = config.hidden_size
        self.layers = [target.model.layers[i] for i in range(self.input_index, n_total)]  # shared, not copied
        self.norm = target.model.norm
        self.rotary_emb = target.model.rotary_emb
        self.lm_head = target.get_output_embeddings()
        self.dtype = next(target.parameters()).dtype
        self.config = target.config

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def log_probs(self, batch: "AdapterBatch", pred: torch.Tensor) -> torch.Tensor:
        """pred [S, Q, n_idx * H]: the adapter's predictions for the batch's blocks (target_indices order) ->
        float32 log-probabilities [S, Q, V] over the full vocabulary; row j = the decoder's law of the token
        after block position j. Differentiable in `pred` only.

        Two passes, as the decoder serves: the context rows fill a cache of keys/values without gradients (they
        do not depend on the prediction; with them in the graph a step cost ~10x more on a CPU), then the block
        rows run over it."""
        sl = slice(self.slot * self.hidden, (self.slot + 1) * self.hidden)
        ctx = batch.ctx_states[..., sl].to(self.dtype)  # [S, T, H] true states at index L-n, zero-padded
        block = pred[..., sl].to(self.dtype)  # [S, Q, H] predicted states at index L-n
        s, t = ctx.shape[:2]
        kv = DynamicCache(config=self.config)
        with torch.no_grad():
            ctx_pos = torch.arange(t, device=ctx.device).expand(s, t)  # [S, T]
            causal = torch.ones(t, t, dtype=torch.bool, device=ctx.device).tril().expand(s, 1, t, t)
            self._layers(ctx, ctx_pos, causal, kv)
        x = self._layers(block, batch.positions.to(block.device), batch.mask.to(block.device)[:, None], kv)
        h = functional_call(self.norm, _detached(self.norm), (x,))  # [S, Q, H]
        bias = None if self.lm_head.bias is None else self.lm_head.bias.detach()
        logits = F.linear(h, self.lm_head.weight.detach(), bias).float()  # [S, Q, V]
        return torch.log_softmax(logits, dim=-1)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, kv: DynamicCache) -> torch.Tensor:
        """x [S, R, H] at positions [S, R] through the top layers, attending to the keys/values already in `kv`
        and to their own (appended to `kv`); allowed [S, 1, R, past + R] (True = attend). A context padding row
        sees at least itself (no empty softmax row), and no block row sees it (the batch's mask stops at the
        block's anchor)."""
        mask = allowed if self.attn_implementation == "sdpa" else torch.zeros(
            allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(self.dtype).min)
        position_embeddings = self.rotary_emb(x, position_ids=positions)  # (cos, sin) [S, R, head_dim]
        for layer in self.layers:
            x = functional_call(layer, _detached(layer), (x,), dict(
                attention_mask=mask, position_ids=positions, cache=kv, use_cache=True,
                position_embeddings=position_embeddings))
        return x


def _detached(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as tensors that take no gradient (same storage)."""
    return {name: p.detach() for name, p in module.named_parameters()}


def kl_loss(logp_pred: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """logp_pred [S, Q, V] the decoder's log-probabilities; topk_ids [S, Q, k] / topk_logp [S, Q, k] the target's
    stored top-k next-token log-probabilities -> (truncated KL, mean over block positions; stats). stats: `kl`
    (float) and `agree`, the fraction of block positions whose argmax of logp_pred is the target's greedy next
    token (topk_ids[..., 0])."""
    logp = topk_logp.float()  # [S, Q, k]
    p = logp.exp()
    logq = logp_pred.gather(-1, topk_ids.long())  # [S, Q, k]
    # A stored log-probability of -inf (p = 0) adds nothing; 0 * (-inf) would be NaN.
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    loss = terms.sum(-1).mean()
    with torch.no_grad():
        agree = (logp_pred.argmax(-1) == topk_ids[..., 0].long()).float().mean()
    return loss, {"kl": float(loss.detach()), "agree": float(agree)}
