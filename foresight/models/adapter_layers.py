"""The layers of the adapter's stages (foresight/models/adapter.py): copies of target decoder layers, run so
that their token mixer reads a context made from other states than the block's input.

    AdapterLayer        a full-attention layer: Llama / Qwen3, and the gated attention of Qwen3.5 / Qwen3-Next
                        (q_proj emits a query and a gate per head, output * sigmoid(gate); RoPE on the first
                        rotary dims of each head only; q_norm / k_norm). Its context: keys/values made by its
                        own input norm + k/v projections (+ k_norm, RoPE at the true positions) from the TRUE
                        context states.
    LinearAdapterLayer  a Gated DeltaNet (linear-attention) layer of Qwen3.5 / Qwen3-Next. Its context: its
                        committed state, the (causal-conv, recurrent) state its own input norm + mixer reach
                        after running over the TRUE context states. A block runs causally from a copy of it.

The norms (incl. Qwen's (1 + w) RMSNorm), the MLP (a mixture of experts in Qwen3-Next) and the Gated DeltaNet
mixer are the target's own modules, deep-copied; the mixer is called with `MixerState`, a one-layer stand-in
for the transformers cache whose tensors are replaced, never written in place, so one committed state can
start many blocks and training back-propagates through the chain of context segments.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .draft_model import _rope

__all__ = ["AdapterLayer", "LinearAdapterLayer", "MixerState", "block_layout"]


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [G, S, heads, d]; cos/sin [G, S, r] with r <= d: RoPE on the first r dims of each head (as the
    target's `apply_rotary_pos_emb`), the rest passes."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return _rope(x, cos, sin)
    return torch.cat([_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = mlp(x)
    return out[0] if isinstance(out, tuple) else out  # some MoE blocks also return their router logits


def _zero_writes(mixer_out: nn.Linear, mlp: nn.Module) -> None:
    """Zero the projections by which a layer writes into the residual stream. Only a dense MLP (one
    `down_proj`) is supported: a mixture of experts has one per expert and a shared one."""
    down = getattr(mlp, "down_proj", None)
    if not isinstance(down, nn.Linear):
        raise NotImplementedError(f"starting a layer as the identity needs a dense MLP, got {type(mlp).__name__}")
    with torch.no_grad():
        for linear in (mixer_out, down):
            linear.weight.zero_()
            if linear.bias is not None:
                linear.bias.zero_()


class AdapterLayer(nn.Module):
    """A copy of one target full-attention decoder layer, run by hand so its attention can read context
    keys/values computed from other states than its block input."""

    def __init__(self, target_layer: nn.Module):
        super().__init__()
        attn = target_layer.self_attn
        self.input_norm = copy.deepcopy(target_layer.input_layernorm)
        self.q_proj = copy.deepcopy(attn.q_proj)
        self.k_proj = copy.deepcopy(attn.k_proj)
        self.v_proj = copy.deepcopy(attn.v_proj)
        self.o_proj = copy.deepcopy(attn.o_proj)
        self.q_norm = copy.deepcopy(attn.q_norm) if getattr(attn, "q_norm", None) is not None else nn.Identity()
        self.k_norm = copy.deepcopy(attn.k_norm) if getattr(attn, "k_norm", None) is not None else nn.Identity()
        self.post_norm = copy.deepcopy(target_layer.post_attention_layernorm)
        self.mlp = copy.deepcopy(target_layer.mlp)
        self.head_dim = attn.head_dim
        self.heads = self.o_proj.in_features // self.head_dim
        self.kv_heads = self.k_proj.out_features // self.head_dim
        # gated attention (Qwen3.5 / Qwen3-Next): q_proj gives per head [query (d), gate (d)]
        self.gated = self.q_proj.out_features == 2 * self.heads * self.head_dim
        self.scaling = float(attn.scaling)

    def context_kv(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """states [G, T, H] (raw residual states) -> k, v [G, T, kv, d], as the target layer would make them."""
        g, t, _ = states.shape
        h = self.input_norm(states)
        k = self.k_norm(self.k_proj(h).view(g, t, self.kv_heads, self.head_dim))
        return _rope_partial(k, cos, sin), self.v_proj(h).view(g, t, self.kv_heads, self.head_dim)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        """x [G, Q, H]; ctx_k/v [G, T, kv, d]; cos/sin [G, Q, r]; mask [G, Q, T+Q] bool (True = attend)."""
        g, q_len, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(g, q_len, self.heads, -1)  # [G, Q, heads, d] (gated: 2d)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        q = _rope_partial(self.q_norm(q), cos, sin)
        k, v = self.context_kv(x, cos, sin)
        keys, values = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)  # [G, T+Q, kv, d]
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=self.scaling)  # [G, heads, Q, d]
        out = out.transpose(1, 2).reshape(g, q_len, self.heads * self.head_dim)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(g, q_len, -1))
        x = x + self.o_proj(out)
        return x + _mlp(self.mlp, self.post_norm(x))

    def start_as_identity(self) -> None:
        """Zero what the layer adds to the residual stream (attention output and MLP down projections): it
        then passes its input through unchanged, and training grows it from there (the other weights keep
        the target's, so their gradients start as soon as the output projections move)."""
        _zero_writes(self.o_proj, self.mlp)


class MixerState:
    """What a transformers Gated DeltaNet forward reads from and writes to its cache, for one layer:
    conv [B, conv_dim, kernel] (the mixer's last `kernel` conv inputs, model dtype) and recurrent
    [B, v_heads, k_dim, v_dim] (float32); None = no past (both all zero). The layer index is ignored."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # keeps the mixer off its one-token path, which updates the conv state in place

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # (transformers >= 5.25) no intermediate recurrent states: the adapter never crops

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """(transformers >= 5.25) the cache's position count; this stand-in keeps none."""

    def update_conv_state(self, conv_in: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """conv_in [B, conv_dim, S] -> the conv's input with its left context [B, conv_dim, kernel + S]."""
        full = conv_in if self.conv is None else torch.cat([self.conv, conv_in], dim=-1)
        k = conv_kernel_size or self.conv.shape[-1]
        self.conv = F.pad(full[..., -k:], (max(0, k - full.shape[-1]), 0)).clone()
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent = recurrent
        return recurrent


class LinearAdapterLayer(nn.Module):
    """A copy of one target Gated DeltaNet decoder layer; its context is a committed (conv, recurrent) state."""

    def __init__(self, target_layer: nn.Module):
        super().__init__()
        self.input_norm = copy.deepcopy(target_layer.input_layernorm)
        self.mixer = copy.deepcopy(target_layer.linear_attn)
        self.post_norm = copy.deepcopy(target_layer.post_attention_layernorm)
        self.mlp = copy.deepcopy(target_layer.mlp)

    def zero_state(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before position 0: conv [rows, conv_dim, kernel] (like's dtype), recurrent [rows, v, dk, dv]."""
        m = self.mixer
        conv = torch.zeros(rows, m.conv_dim, m.conv_kernel_size, dtype=like.dtype, device=like.device)
        rec = torch.zeros(rows, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=like.device)
        return conv, rec

    def context_state(self, states: torch.Tensor, state=None):
        """states [G, T, H] TRUE context states continuing `state` (conv, recurrent [G, ...] or None) -> the
        mixer's state after them (a new tuple; None if T = 0 and state is None)."""
        if states.shape[1] == 0:
            return state
        cache = MixerState() if state is None else MixerState(*state)
        self.mixer(hidden_states=self.input_norm(states), cache=cache)
        return cache.conv, cache.recurrent

    def forward(self, x: torch.Tensor, state=None) -> torch.Tensor:
        """x [G, S, H], causally, each row continuing its state (conv, recurrent [G, ...] or None) -> [G, S, H]."""
        cache = MixerState() if state is None else MixerState(*state)
        x = x + self.mixer(hidden_states=self.input_norm(x), cache=cache)
        return x + _mlp(self.mlp, self.post_norm(x))

    def start_as_identity(self) -> None:
        """As `AdapterLayer.start_as_identity`: the mixer's output and the MLP's down projections zeroed."""
        _zero_writes(self.mixer.out_proj, self.mlp)

    def block_start_states(self, ctx: torch.Tensor, ctx_lens: torch.Tensor):
        """Training. ctx [G, T, H] TRUE context states; ctx_lens [G, A] the context length (anchor) of each
        block -> the state before each block, conv [G*A, conv_dim, kernel], recurrent [G*A, v, dk, dv] (row-
        major). A recurrence has no mask: per row the mixer runs over its context once, in segments ending at
        its distinct anchors, carrying the state (gradients flow through the chain)."""
        convs, recs = [], []
        for g, lens in enumerate(ctx_lens.tolist()):
            at, state, done = {0: self.zero_state(1, ctx)}, None, 0
            for n in sorted(set(lens) - {0}):
                state = self.context_state(ctx[g:g + 1, done:n], state)
                at[n], done = state, n
            convs += [at[n][0] for n in lens]
            recs += [at[n][1] for n in lens]
        return torch.cat(convs), torch.cat(recs)


def block_layout(mask: torch.Tensor, t: int) -> tuple[torch.Tensor, int]:
    """mask [G, Q, T+Q] of `Adapter.forward_blocks` -> (ctx_lens [G, A], A): each row holds A contiguous blocks
    of Q/A positions, block a of row g sees the context positions < ctx_lens[g, a] and itself causally. A
    linear-attention layer follows this layout (not the mask): any other mask raises ValueError."""
    g, q = mask.shape[:2]
    n_blocks = 1 + int((~mask[0, 1:, t:-1].diagonal(dim1=-2, dim2=-1)).sum())  # position i+1 does not see i
    size = q // n_blocks
    if q % n_blocks:
        raise ValueError(f"linear-attention layers need equal blocks; {q} positions do not split into {n_blocks}")
    ctx_lens = mask[:, ::size, :t].sum(-1)  # [G, A]
    want = torch.zeros_like(mask)
    want[:, :, :t] = torch.arange(t, device=mask.device) < ctx_lens.repeat_interleave(size, dim=1)[..., None]
    causal = torch.ones(size, size, device=mask.device).tril()
    want[:, :, t:] = torch.kron(torch.eye(n_blocks, device=mask.device), causal).bool()
    if not torch.equal(mask, want):
        raise ValueError("linear-attention layers need the mask of equal contiguous blocks, each seeing a context "
                         "prefix and itself causally (sample_adapter_blocks)")
    return ctx_lens, n_blocks
