"""JetSpec-style causal parallel draft model (JetSpec++ section 3.1 and 4.3).

One forward drafts a whole block: block position i reads the block's real input tokens at positions
<= i (causal inside the block) plus the target's hidden states of the verified context, and predicts
token i+1 through the target's frozen LM head.

    context:  target states at `target_layers` [T, n_src * H_t]  --per-source RMS, linear, RMSNorm-->  c [T, H]
              every draft layer attends to keys/values made from c (its own k/v projections, RoPE at the
              true positions), so the context K/V of a request can be cached and extended incrementally.
    block:    x_i = RMSNorm(embed(y_i)) + c_{n-1} + pos_emb[i]      (n = the anchor's position, y_0 = anchor)
              -> draft layers (queries from the block; keys = context + block, causal in the block)
              -> RMSNorm -> target LM head (rows restricted to a vocabulary subset) -> argmax -> full-vocab id
    Jacobi:   J0 inputs = anchor + noise tokens drawn from the verified context; pass r feeds
              [anchor, d^(r-1)_1 .. d^(r-1)_{n-1}] back. Causal attention makes position i final after i+1
              passes, so n passes always reach the fixed point.

The target's embedding and LM head are shared and frozen: they are copied in at load time from the
target model and never written to the checkpoint (a folder: config.json + model.safetensors).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT = "foresight-jetspec-drafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def default_target_layers(num_layers: int) -> list[int]:
    """Hidden-state indices to read (index i = output of layer i-1; index num_layers = post-final-norm).
    For a 30-layer target: 3, 15, 27, 30."""
    picks = [max(1, num_layers // 10), num_layers // 2, num_layers - 3, num_layers]
    return sorted({min(num_layers, max(1, p)) for p in picks})


@dataclass(slots=True)
class DraftConfig:
    target_hidden_size: int
    target_layers: list[int]  # target hidden-state indices, concatenated in this order
    vocab_size: int  # the target's vocabulary
    hidden_size: int  # = the target's embedding width (shared embedding and LM head)
    num_layers: int = 3
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 16  # anchor + drafts per training block (in-block position embeddings)
    context_window: int = 512  # the newest context positions a block attends to
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    logit_softcap: float | None = None  # Gemma-style final_logit_softcapping of the target
    vocab_subset_size: int = 0  # 0 = full vocabulary
    default_passes: int = 1  # Jacobi passes after J0 the proposer runs unless told otherwise
    storage_dtype: str = "float16"
    target_name: str = ""
    format: str = FORMAT
    extra: dict = field(default_factory=dict)  # training recipe, data summary (informational)

    @classmethod
    def for_target(cls, target_config, **overrides) -> "DraftConfig":
        hidden = target_config.hidden_size
        head_dim = getattr(target_config, "head_dim", None) or hidden // target_config.num_attention_heads
        heads = max(1, hidden // head_dim)
        kv = getattr(target_config, "num_key_value_heads", heads) or heads
        kv = kv if heads % kv == 0 else heads
        base = dict(target_hidden_size=hidden, target_layers=default_target_layers(target_config.num_hidden_layers),
                    vocab_size=target_config.vocab_size, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                    head_dim=head_dim, intermediate_size=target_config.intermediate_size,
                    logit_softcap=getattr(target_config, "final_logit_softcapping", None))
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DraftConfig":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a Foresight JetSpec drafter config (format={data.get('format')!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def read(cls, folder: str | Path) -> "DraftConfig":
        """The config of the checkpoint folder `folder`."""
        return cls.from_dict(json.loads((Path(folder) / CONFIG_FILE).read_text()))


@dataclass(slots=True)
class SharedWeights:
    """What the draft model borrows from the target (frozen, not stored in the checkpoint)."""

    embed_weight: torch.Tensor  # [vocab, H]
    lm_head_weight: torch.Tensor  # [vocab, H]
    embed_scale: float = 1.0  # Gemma scales embeddings by sqrt(H)

    @classmethod
    def from_target(cls, target) -> "SharedWeights":
        emb = target.get_input_embeddings()
        scale = getattr(emb, "embed_scale", 1.0)
        scale = float(scale.item() if torch.is_tensor(scale) else scale)
        return cls(emb.weight.detach(), target.get_output_embeddings().weight.detach(), scale)


@dataclass(slots=True)
class ContextKV:
    """One request's projected context, ready to attend to (positions ascending, at most the window)."""

    keys: list[torch.Tensor]  # per draft layer [T, kv_heads, head_dim], RoPE applied at `positions`
    values: list[torch.Tensor]  # per draft layer [T, kv_heads, head_dim]
    positions: torch.Tensor  # [T] true positions in the sequence
    last: torch.Tensor  # [H] projected state of the newest context position (the one before the anchor)

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclass(slots=True)
class ContextBatch:
    """Several requests' contexts side by side, each left-padded to the longest (T columns): what a block pass
    after them reads."""

    start: torch.Tensor  # [B] long: the true position of each row's anchor
    anchor_state: torch.Tensor  # [B, 1, H] projected state of each row's newest context position
    keys: list[torch.Tensor]  # per draft layer [B, T, kv_heads, head_dim]
    values: list[torch.Tensor]  # per draft layer [B, T, kv_heads, head_dim]
    valid: torch.Tensor  # [B, T] bool: a column holds a context position (False: left padding)

    def __iter__(self):
        return iter((self.start, self.anchor_state, self.keys, self.values, self.valid))

    @property
    def columns(self) -> int:
        return int(self.valid.shape[1])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [G, S, heads, d]; cos/sin [G, S, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class DraftLayer(nn.Module):
    """Pre-norm transformer layer whose attention also reads the context keys/values."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ctx [G, T, H] (already projected and normed) -> k, v [G, T, kv_heads, d]."""
        g, t, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(g, t, self.kv_heads, self.head_dim))
        return _rope(k, cos, sin), self.v_proj(ctx).view(g, t, self.kv_heads, self.head_dim)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        """x [G, Q, H]; ctx_k/v [G, T, kv, d]; cos/sin [G, Q, d]; mask [G, Q, T+Q] bool (True = attend)."""
        g, q_len, _ = x.shape
        h = self.input_norm(x)
        q = _rope(self.q_norm(self.q_proj(h).view(g, q_len, self.heads, self.head_dim)), cos, sin)
        k = _rope(self.k_norm(self.k_proj(h).view(g, q_len, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(h).view(g, q_len, self.kv_heads, self.head_dim)
        keys = torch.cat([ctx_k, k], dim=1)  # [G, T+Q, kv, d]
        values = torch.cat([ctx_v, v], dim=1)
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None])  # [G, heads, Q, d]
        x = x + self.o_proj(out.transpose(1, 2).reshape(g, q_len, self.heads * self.head_dim))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig, shared: SharedWeights, vocab_subset: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        if shared.embed_weight.shape[1] != h:
            raise ValueError(f"draft hidden size {h} != target embedding width {shared.embed_weight.shape[1]}")
        self.ctx_proj = nn.Linear(len(cfg.target_layers) * cfg.target_hidden_size, h, bias=False)
        self.ctx_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.block_pos = nn.Embedding(cfg.block_size, h)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.apply(self._init)
        # The residual carries the normalised input embedding; with the target's (tied, unit-scale)
        # LM head a unit final norm would make "repeat the input token" a ~77-logit prediction at init.
        nn.init.constant_(self.norm.weight, 0.1)
        if vocab_subset is None:
            vocab_subset = torch.arange(cfg.vocab_size)
        vocab_subset = vocab_subset.long()
        cfg.vocab_subset_size = 0 if len(vocab_subset) == cfg.vocab_size else len(vocab_subset)
        # Shared, frozen and not saved: buffers (not parameters), non-persistent.
        self.register_buffer("embed_weight", shared.embed_weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head", shared.lm_head_weight.detach()[vocab_subset].clone(), persistent=False)
        self.register_buffer("vocab_subset", vocab_subset, persistent=False)
        self.embed_scale = shared.embed_scale
        self.compiled = None  # a CompiledDraft (models/compiled_draft.py): the pass and extension as graphs

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        return self.ctx_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.ctx_proj.weight.device

    # ------------------------------------------------------------------ pieces

    def project_context(self, states: torch.Tensor) -> torch.Tensor:
        """Target states [..., T, n_src * H_t] -> [..., T, H]. Each source layer is RMS-normalised first
        (in float32: middle-layer states reach 2.6e4, whose square overflows fp16)."""
        n_src = len(self.config.target_layers)
        x = states.float().unflatten(-1, (n_src, self.config.target_hidden_size))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.ctx_norm(self.ctx_proj(x.flatten(-2).to(self.dtype)))

    def rope(self, positions: torch.Tensor):
        """positions [G, S] -> cos, sin [G, S, d] in the model dtype."""
        d = self.config.head_dim  # kept in float32 whatever the model dtype
        inv_freq = self.config.rope_theta ** -(torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d)
        angles = positions.float()[..., None] * inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight) * self.embed_scale

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor):
        """ctx [G, T, H] projected states at positions [G, T] -> per-layer lists of k, v [G, T, kv, d]."""
        cos, sin = self.rope(positions)
        kv = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
        return [k for k, _ in kv], [v for _, v in kv]

    def forward_hidden(self, tokens, block_idx, positions, anchor_state, ctx_keys, ctx_values, mask):
        """The block pass.

        tokens [G, Q] input ids; block_idx [G, Q] position inside the block (0 = anchor); positions [G, Q]
        true positions; anchor_state [G, Q, H] projected state before each block's anchor; ctx_keys/values
        per layer [G, T, kv, d]; mask [G, Q, T+Q] bool. Returns [G, Q, H] (after the final norm)."""
        pos_idx = block_idx.clamp(max=self.config.block_size - 1)  # longer blocks reuse the last embedding
        x = self.embed_norm(self.embed(tokens).to(self.dtype)) + anchor_state + self.block_pos(pos_idx)
        cos, sin = self.rope(positions)
        for layer, k, v in zip(self.layers, ctx_keys, ctx_values):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., vocab subset] float32 logits."""
        out = F.linear(hidden, self.lm_head.to(hidden.dtype)).float()
        cap = self.config.logit_softcap
        return cap * torch.tanh(out / cap) if cap else out

    # ------------------------------------------------------------------ training: many blocks per context

    def forward_blocks(self, ctx_states, ctx_positions, tokens, block_idx, positions, anchor_index, mask):
        """Blocks grouped by the sequence they come from (training).

        ctx_states [G, T, n_src*H_t]; ctx_positions [G, T]; tokens/block_idx/positions [G, Q];
        anchor_index [G, Q] index into T of the state before each query's anchor; mask [G, Q, T+Q].
        Returns hidden [G, Q, H]."""
        ctx = self.project_context(ctx_states)  # [G, T, H]
        keys, values = self.context_kv(ctx, ctx_positions)
        anchor_state = ctx.gather(1, anchor_index[..., None].expand(-1, -1, ctx.shape[-1]))  # [G, Q, H]
        return self.forward_hidden(tokens, block_idx, positions, anchor_state, keys, values, mask)

    # ------------------------------------------------------------------ inference: cached context per request

    @torch.inference_mode()
    def extend_context(self, ctx: ContextKV | None, states: torch.Tensor, start: int) -> ContextKV:
        """Append target states [n, n_src*H_t] for positions start..start+n-1; keep the newest window."""
        w = self.config.context_window
        if ctx is not None and len(ctx) and int(ctx.positions[-1]) + 1 != start:
            raise ValueError(f"context gap: have up to {int(ctx.positions[-1])}, got states from {start}")
        if states.shape[0] >= w:  # a long chunk (a prompt) replaces everything: project only its window
            ctx, start, states = None, start + states.shape[0] - w, states[-w:]
        states = states.to(self.device, torch.float32)  # project_context normalises in fp32 anyway
        positions = torch.arange(start, start + states.shape[0], device=self.device)
        if self.compiled is not None and self.compiled.takes_context(states.shape[0]):
            keys, values, last = self.compiled.context(states, positions)
        else:
            keys, values, last = self.new_context(states, positions)
        if ctx is not None and len(ctx):
            keys = [torch.cat([a, b]) for a, b in zip(ctx.keys, keys)]
            values = [torch.cat([a, b]) for a, b in zip(ctx.values, values)]
            positions = torch.cat([ctx.positions, positions])
        if len(positions) > w:
            keys, values, positions = [k[-w:] for k in keys], [v[-w:] for v in values], positions[-w:]
        return ContextKV(keys, values, positions, last)

    def new_context(self, states: torch.Tensor, positions: torch.Tensor):
        """Target states [n, n_src*H_t] (fp32) at positions [n] -> per draft layer keys and values [n, kv, d], and
        the projected state of the newest position [H]."""
        proj = self.project_context(states[None])  # [1, n, H]
        keys, values = self.context_kv(proj, positions[None])
        return [k[0] for k in keys], [v[0] for v in values], proj[0, -1]

    def encode_context(self, states: torch.Tensor) -> ContextKV:
        """Target states of positions 0..T-1 [T, n_src*H_t] (only the last window is kept)."""
        return self.extend_context(None, states, 0)

    def draft(self, contexts: list[ContextKV], anchors: torch.Tensor, noise: torch.Tensor, passes: int = 1,
              early_exit: bool = True) -> list[torch.Tensor]:
        """Draft a batch of blocks: row b continues contexts[b] after anchors[b].

        anchors [B]; noise [B, n-1] J0 input tokens; returns passes+1 tensors [B, n] of full-vocab draft ids
        (J0, J1, ...). Once the inputs stop changing (a Jacobi fixed point) later passes are copies."""
        inputs = torch.cat([anchors.long()[:, None], noise.long()], dim=1)  # [B, n]
        return self._draft(contexts, inputs, None, passes, early_exit, with_probs=False)[0]

    def draft_with_confidence(self, contexts: list[ContextKV], anchors: torch.Tensor, noise: torch.Tensor,
                              passes: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As `draft`, plus each pass's top-1 probability (over the vocabulary subset) of every drafted
        token: (ids, probs), each passes+1 tensors [B, n]."""
        inputs = torch.cat([anchors.long()[:, None], noise.long()], dim=1)  # [B, n]
        return self._draft(contexts, inputs, None, passes, True, with_probs=True)

    def draft_after_prefix(self, contexts: list[ContextKV], inputs: torch.Tensor, fixed: torch.Tensor,
                           passes: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As `draft_with_confidence`, but the first fixed[b] inputs of row b are real tokens that the Jacobi
        passes keep (the anchor and the tokens after it, at block positions 0..fixed[b]-1); the rest of
        inputs [B, n] are J0 noise, then right-padding. Training's clean prefixes are of this kind. Position
        i predicts the token after input i: row b's draft starts at position fixed[b]-1."""
        return self._draft(contexts, inputs.long(), fixed, passes, True, with_probs=True)

    @torch.inference_mode()
    def block_logits(self, contexts: list[ContextKV], inputs: torch.Tensor) -> torch.Tensor:
        """One pass over given inputs [B, n] (anchor first; right-padding is harmless) -> the logits over the
        vocabulary subset [B, n, V'] (float32): position i's distribution of the token after input i."""
        return self.logits(self.block_pass(inputs.to(self.device).long(), *self.context_batch(contexts)))

    def context_batch(self, contexts: list[ContextKV]) -> ContextBatch:
        """`contexts` side by side, each left-padded to the longest."""
        dev = self.device
        b = len(contexts)
        t = max((len(c) for c in contexts), default=0)
        kv = self.config.num_kv_heads, self.config.head_dim
        keys = [torch.zeros(b, t, *kv, dtype=self.dtype, device=dev) for _ in self.layers]
        values = [torch.zeros(b, t, *kv, dtype=self.dtype, device=dev) for _ in self.layers]
        valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
        anchor_state = torch.zeros(b, 1, self.config.hidden_size, dtype=self.dtype, device=dev)
        start = torch.zeros(b, dtype=torch.long, device=dev)
        for row, c in enumerate(contexts):
            if not len(c):
                continue
            lo = t - len(c)
            for i in range(len(self.layers)):
                keys[i][row, lo:] = c.keys[i]
                values[i][row, lo:] = c.values[i]
            valid[row, lo:] = True
            anchor_state[row, 0] = c.last
            start[row] = c.positions[-1] + 1
        return ContextBatch(start, anchor_state, keys, values, valid)

    def block_pass(self, inputs: torch.Tensor, start: torch.Tensor, anchor_state: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """Blocks of inputs [B, n] (anchor first) after a `ContextBatch`'s contexts -> hidden [B, n, H]: block
        position i at true position start + i, attending to its context's valid columns and causally in the
        block."""
        b, n = inputs.shape
        block_idx = torch.arange(n, device=inputs.device).expand(b, n)  # [B, n]
        positions = start[:, None] + block_idx
        causal = torch.ones(n, n, dtype=torch.bool, device=inputs.device).tril()
        mask = torch.cat([valid[:, None, :].expand(b, n, valid.shape[1]), causal.expand(b, n, n)], dim=-1)
        return self.forward_hidden(inputs, block_idx, positions, anchor_state, keys, values, mask)

    def pass_ids(self, inputs: torch.Tensor, batch: ContextBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One block pass -> each position's draft (full-vocabulary ids [B, n]) and its top-1 probability over
        the vocabulary subset [B, n] float32; through the compiled graph where one takes the batch."""
        if self.compiled is not None and self.compiled.takes(*inputs.shape, batch.columns):
            return self.compiled(inputs, batch)
        return self.ids_and_confidence(self.block_pass(inputs, *batch))

    def ids_and_confidence(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> the argmax's full-vocabulary id [...] and its probability [...] (float32)."""
        logits = self.logits(hidden)  # [..., vocab subset]
        return self.vocab_subset[logits.argmax(-1)], torch.softmax(logits, dim=-1).amax(-1)

    @torch.inference_mode()
    def _draft(self, contexts: list[ContextKV], inputs: torch.Tensor, fixed: torch.Tensor | None, passes: int,
               early_exit: bool, with_probs: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Jacobi passes from inputs [B, n]; fixed [B] leading inputs stay (None: the anchor alone)."""
        inputs = inputs.to(self.device)
        b, n = inputs.shape
        batch = self.context_batch(contexts)
        block_idx = torch.arange(n, device=self.device).expand(b, n)
        keep = block_idx < (1 if fixed is None else fixed.to(self.device)[:, None])  # [B, n]
        outs: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for r in range(passes + 1):
            ids, confidence = self.pass_ids(inputs, batch)  # [B, n] each
            outs.append(ids)
            if with_probs:
                probs.append(confidence)
            nxt = torch.where(keep, inputs, torch.cat([inputs[:, :1], ids[:, :-1]], dim=1))
            if early_exit and torch.equal(nxt, inputs):
                outs.extend([ids] * (passes - r))
                probs.extend(probs[-1:] * (passes - r))
                break
            inputs = nxt
        return outs, probs

    def draft_pass(self, contexts: list[ContextKV], inputs: torch.Tensor) -> torch.Tensor:
        """One pass from given inputs: inputs [B, n] = each row's anchor, then its Jacobi inputs (right-padding
        is harmless: the block attends causally). Returns the drafts [B, n]; position i predicts the token
        after input i."""
        return self.draft(contexts, inputs[:, 0], inputs[:, 1:], passes=0)[0]

    def draft_from_states(self, states: torch.Tensor, tokens: list[int], n_tokens: int, passes: int = 1,
                          generator: torch.Generator | None = None) -> list[list[int]]:
        """One block from scratch: states [len(tokens)-1, n_src*H_t] of every verified token but the anchor
        tokens[-1]; J0 noise drawn from `tokens`. Returns the draft of every pass."""
        noise = draw_noise(tokens, n_tokens - 1, generator)
        outs = self.draft([self.encode_context(states)], torch.tensor([tokens[-1]]), noise[None], passes)
        return [o[0].tolist() for o in outs]

    # ------------------------------------------------------------------ checkpoint folder

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = getattr(torch, self.config.storage_dtype)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.named_parameters()}
        tensors["vocab_subset"] = self.vocab_subset.detach().to("cpu", torch.int32).contiguous()
        tmp = path / (WEIGHTS_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        tmp.replace(path / WEIGHTS_FILE)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, shared: SharedWeights, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "DraftModel":
        path = Path(path)
        cfg = DraftConfig.read(path)
        tensors = load_file(str(path / WEIGHTS_FILE))
        subset = tensors.pop("vocab_subset").long()
        model = cls(cfg, shared, subset)
        model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters())


def is_checkpoint(path: str | Path, fmt: str = FORMAT) -> bool:
    """A folder holding config.json (whose "format" is `fmt`) and model.safetensors."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == fmt
    except (OSError, ValueError):
        return False


def draw_noise(tokens: list[int] | torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """`count` tokens drawn uniformly (with replacement) from the verified context `tokens`."""
    pool = torch.as_tensor(tokens, dtype=torch.long)
    if count <= 0:
        return pool.new_zeros(0)
    idx = torch.randint(0, len(pool), (count,), generator=generator)
    return pool[idx]


__all__ = ["DraftConfig", "DraftModel", "SharedWeights", "ContextKV", "default_target_layers", "draw_noise",
           "is_checkpoint"]
