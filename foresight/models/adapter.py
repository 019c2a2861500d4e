"""The hidden-to-hidden adapter of foresight drafting (JetSpec++ section 4.2; docs/architecture.md).

In one parallel pass it predicts the target's hidden states at `target_indices` (hidden-state index i =
raw output of decoder layer i-1, the residual stream, NOT normed; default for a 30-layer target 3, 15, 27)
for the gamma+1 positions of a block [y0, d_1..d_gamma] whose tokens are known, given the TRUE cached
states of the verified context at those same indices.

    stage s (one per index l = target_indices[s], ascending): a short stack of transformer layers,
        initialised as copies of the target layers just below l (l-1, or l-2 and l-1).
        input   the prediction of the stage below (the target's shared token embeddings, index 0, at the bottom)
        context every layer of the stage attends to keys/values made by ITS OWN input norm + k/v projections
                (RoPE at the true positions) from the TRUE context states at index l; cached per request and
                extended incrementally (`AdapterContext`)
        block   causal inside the block; queries/keys at the block's true positions
        output  the predicted residual-stream states at index l (the input of the next stage)

Why the context is read at index l and not at l-1 (the input of the copied layer l-1): the target ships,
and the labelled data stores, only the indices the draft model reads ([3, 15, 27, 30]); l-1 is not among
them, and the paper's adapter attends to the cached prefix at layer l (h^l_{<n}). Index l is one layer away
from what the copied layer saw in the target; training absorbs that mismatch.

What the initialisation makes exact (tests/unit/test_adapter.py): a 1-layer stage copied from target layer
l-1, given the TRUE block states at index l-1 as input and context keys/values computed from the TRUE
context states at index l-1, reproduces the target's index-l states exactly (it IS target layer l-1, run by
hand). Hence with consecutive indices (l- = l-1, embeddings at the bottom for l=1) and the context slots
filled with the index-(l-1) states, `predict` reproduces the target exactly. With the served inputs (context
at index l, inputs from the stage below at l- < l-1) it is only an initialisation.

Only models whose layers have the Llama structure and full attention (llama, qwen3) are supported.
The checkpoint is a folder (config.json + model.safetensors, fp16); the token embedding and the RoPE
frequencies come from the target at load time and are never stored.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .decoder import SUPPORTED_MODEL_TYPES
from .draft_model import SharedWeights, _rope, default_target_layers, is_checkpoint

FORMAT = "foresight-adapter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

__all__ = ["AdapterConfig", "Adapter", "AdapterContext", "default_adapter_indices", "is_adapter_checkpoint"]


def default_adapter_indices(num_layers: int) -> list[int]:
    """The raw (pre-final-norm) indices the draft model reads: 3, 15, 27 for a 30-layer target."""
    return [i for i in default_target_layers(num_layers) if i < num_layers]


@dataclass(slots=True)
class AdapterConfig:
    target_indices: list[int]  # ascending hidden-state indices predicted (and read as context)
    stage_layers: list[list[int]]  # per stage, the target layers its layers were copied from (for structure)
    hidden_size: int
    num_target_layers: int
    storage_dtype: str = "float16"
    target_name: str = ""
    format: str = FORMAT
    extra: dict = field(default_factory=dict)  # training recipe, loss scales, data summary (informational)
    # Target layers the foresight decoder should reuse with this adapter (None: all layers above its deepest
    # index). A deeper decoder reads a shallower, better-predicted index: measured on SmolLM2, the top 15
    # layers over the index-15 prediction agree with the target's next token 2x as often as the top 3
    # layers over the index-27 one (docs/benchmark.md).
    decoder_layers: int | None = None

    @classmethod
    def for_target(cls, target_config, target_indices: list[int], layers_per_stage: int = 1,
                   bottom_layers: int | None = None, **overrides) -> "AdapterConfig":
        """Stage l copies target layers l-k..l-1 (k = layers_per_stage; the bottom stage k = bottom_layers,
        default layers_per_stage; clipped at layer 0)."""
        n = target_config.num_hidden_layers
        idx = sorted(int(i) for i in target_indices)
        if not idx or len(set(idx)) != len(idx) or idx[0] < 1 or idx[-1] >= n:
            raise ValueError(f"target_indices must be distinct raw indices in [1, {n - 1}] (index {n} is the "
                             f"post-final-norm state), got {target_indices}")
        bottom = layers_per_stage if bottom_layers is None else bottom_layers
        if layers_per_stage < 1 or bottom < 1:
            raise ValueError("layers_per_stage and bottom_layers must be >= 1")
        stages = [list(range(max(0, l - (bottom if s == 0 else layers_per_stage)), l)) for s, l in enumerate(idx)]
        return cls(target_indices=idx, stage_layers=stages, hidden_size=target_config.hidden_size,
                   num_target_layers=n, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AdapterConfig":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a Foresight adapter config (format={data.get('format')!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(slots=True)
class AdapterContext:
    """One request's verified context: per stage, per layer, keys/values [T, kv_heads, head_dim] (RoPE applied)
    of positions 0..T-1. Never modified in place: `extend_context` returns a new one."""

    keys: list[list[torch.Tensor]] = field(default_factory=list)
    values: list[list[torch.Tensor]] = field(default_factory=list)
    length: int = 0

    def __len__(self) -> int:
        return self.length


class AdapterLayer(nn.Module):
    """A copy of one target decoder layer (Llama structure), run by hand so its attention can read
    context keys/values computed from other states than its block input."""

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
        self.heads = self.q_proj.out_features // self.head_dim
        self.kv_heads = self.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)

    def context_kv(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """states [G, T, H] (raw residual states) -> k, v [G, T, kv, d], as the target layer would make them."""
        g, t, _ = states.shape
        h = self.input_norm(states)
        k = self.k_norm(self.k_proj(h).view(g, t, self.kv_heads, self.head_dim))
        return _rope(k, cos, sin), self.v_proj(h).view(g, t, self.kv_heads, self.head_dim)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        """x [G, Q, H]; ctx_k/v [G, T, kv, d]; cos/sin [G, Q, d]; mask [G, Q, T+Q] bool (True = attend)."""
        g, q_len, _ = x.shape
        h = self.input_norm(x)
        q = _rope(self.q_norm(self.q_proj(h).view(g, q_len, self.heads, self.head_dim)), cos, sin)
        k, v = self.context_kv(x, cos, sin)
        keys, values = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)  # [G, T+Q, kv, d]
        rep = self.heads // self.kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=self.scaling)  # [G, heads, Q, d]
        x = x + self.o_proj(out.transpose(1, 2).reshape(g, q_len, self.heads * self.head_dim))
        return x + self.mlp(self.post_norm(x))


class Adapter(nn.Module):
    def __init__(self, config: AdapterConfig, target_model):
        super().__init__()
        tcfg = target_model.config.get_text_config(decoder=True)
        if getattr(tcfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(f"adapter supports model types {SUPPORTED_MODEL_TYPES}, got {tcfg.model_type!r}")
        layer_types = getattr(tcfg, "layer_types", None) or ["full_attention"] * tcfg.num_hidden_layers
        used = {i for stage in config.stage_layers for i in stage}
        if any(layer_types[i] != "full_attention" for i in used):
            raise NotImplementedError("adapter supports only full-attention layers")
        if tcfg.hidden_size != config.hidden_size or tcfg.num_hidden_layers != config.num_target_layers:
            raise ValueError("adapter config does not match the target model")
        self.config = config
        layers = target_model.model.layers
        self.stages = nn.ModuleList(nn.ModuleList(AdapterLayer(layers[i]) for i in stage)
                                    for stage in config.stage_layers)
        # RoPE tables from the target's inverse frequencies (incl. any rope-type rescaling), kept as a plain
        # float32 attribute: a buffer would be cast by .to(fp16), and fp16 angles are wrong at long positions.
        rot = target_model.model.rotary_emb
        self._inv_freq = rot.inv_freq.detach().float().cpu().clone()
        self._rope_scaling = float(rot.attention_scaling)
        shared = SharedWeights.from_target(target_model)
        self.register_buffer("embed_weight", shared.embed_weight, persistent=False)  # shared, frozen, not stored
        self.embed_scale = shared.embed_scale

    # ------------------------------------------------------------------ construction / checkpoint

    @classmethod
    def from_target(cls, target_model, target_indices: list[int] | None = None, layers_per_stage: int = 1,
                    bottom_layers: int | None = None) -> "Adapter":
        """Stages initialised from the target layers just below each index. `bottom_layers` (default
        layers_per_stage) sets the bottom stage's depth: bottom_layers=3 copies ALL of layers 0..2 for index 3,
        which on SmolLM2 lifts the initial cosine at indices 3/15/27 from 0.44/0.48/0.29 to 0.95/0.74/0.74."""
        tcfg = target_model.config.get_text_config(decoder=True)
        idx = default_adapter_indices(tcfg.num_hidden_layers) if target_indices is None else target_indices
        cfg = AdapterConfig.for_target(tcfg, idx, layers_per_stage, bottom_layers,
                                       target_name=getattr(tcfg, "_name_or_path", "") or "")
        param = next(target_model.parameters())
        return cls(cfg, target_model).to(device=param.device, dtype=param.dtype)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = getattr(torch, self.config.storage_dtype)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.named_parameters()}
        tmp = path / (WEIGHTS_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        tmp.replace(path / WEIGHTS_FILE)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, target_model, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "Adapter":
        path = Path(path)
        cfg = AdapterConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        model = cls(cfg, target_model)
        model.load_state_dict({k: v.float() for k, v in load_file(str(path / WEIGHTS_FILE)).items()}, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def truncate(self, deepest_index: int) -> "Adapter":
        """Drop the stages above hidden-state index `deepest_index` (in place): a decoder that starts at a
        shallower index than the adapter's deepest needs only the stages up to its input."""
        keep = [i for i, idx in enumerate(self.config.target_indices) if idx <= deepest_index]
        if not keep:
            raise ValueError(f"the adapter predicts {self.target_indices}: nothing at or below {deepest_index}")
        self.stages = nn.ModuleList(self.stages[i] for i in keep)
        self.config = dataclasses.replace(self.config, target_indices=[self.config.target_indices[i] for i in keep],
                                          stage_layers=[self.config.stage_layers[i] for i in keep])
        return self

    # ------------------------------------------------------------------ pieces

    @property
    def target_indices(self) -> list[int]:
        return list(self.config.target_indices)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def rope(self, positions: torch.Tensor):
        """positions [G, S] -> cos, sin [G, S, d] in the model dtype (angles in float32, as the target does)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        angles = positions.float()[..., None] * self._inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return (emb.cos() * self._rope_scaling).to(self.dtype), (emb.sin() * self._rope_scaling).to(self.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (F.embedding(tokens, self.embed_weight) * self.embed_scale).to(self.dtype)

    def split(self, states: torch.Tensor) -> list[torch.Tensor]:
        """[..., n_idx * H] -> per index [..., H] (in the model dtype)."""
        return list(states.to(self.dtype).unflatten(-1, (len(self.stages), self.config.hidden_size)).unbind(-2))

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor):
        """states [G, T, n_idx*H] true context states at positions [G, T] -> per stage, per layer k, v lists."""
        cos, sin = self.rope(positions)
        keys, values = [], []
        for stage, h in zip(self.stages, self.split(states)):
            kv = [layer.context_kv(h, cos, sin) for layer in stage]
            keys.append([k for k, _ in kv])
            values.append([v for _, v in kv])
        return keys, values

    def run_stages(self, x, keys, values, positions, mask) -> list[torch.Tensor]:
        """x [G, Q, H] bottom input (embeddings); keys/values per stage per layer [G, T, kv, d]; positions [G, Q];
        mask [G, Q, T+Q]. Each stage reads the previous stage's prediction. Returns per index [G, Q, H]."""
        cos, sin = self.rope(positions)
        outs = []
        for stage, ks, vs in zip(self.stages, keys, values):
            for layer, k, v in zip(stage, ks, vs):
                x = layer(x, k, v, cos, sin, mask)
            outs.append(x)
        return outs

    # ------------------------------------------------------------------ training: many blocks per context

    def forward_blocks(self, ctx_states, tokens, positions, mask) -> torch.Tensor:
        """ctx_states [G, T, n_idx*H] true states of positions 0..T-1 (zero-padded rows are masked out);
        tokens/positions [G, Q] (any number of blocks per row); mask [G, Q, T+Q] bool.
        Returns the predictions [G, Q, n_idx*H] (target_indices order)."""
        g, t = ctx_states.shape[:2]
        ctx_pos = torch.arange(t, device=tokens.device).expand(g, t)
        keys, values = self.context_kv(ctx_states, ctx_pos)
        return torch.cat(self.run_stages(self.embed(tokens), keys, values, positions, mask), dim=-1)

    # ------------------------------------------------------------------ inference: cached context per request

    def new_context(self) -> AdapterContext:
        return AdapterContext([[] for _ in self.stages], [[] for _ in self.stages], 0)

    @torch.inference_mode()
    def extend_context(self, actx: AdapterContext, states: torch.Tensor, start_pos: int) -> AdapterContext:
        """A new context = actx's positions < start_pos + `states` [n, n_idx*H] (true states, target_indices order)
        at positions start_pos..start_pos+n-1. start_pos may lie before the end (the tail is replaced, e.g. a
        rollback) but not after it. actx itself is not modified, so contexts can branch."""
        if not 0 <= start_pos <= actx.length:
            raise ValueError(f"context holds positions 0..{actx.length - 1}; cannot extend at {start_pos}")
        n = states.shape[0]
        positions = torch.arange(start_pos, start_pos + n, device=self.device)[None]
        keys, values = self.context_kv(states.to(self.device)[None], positions)
        cat = lambda old, new: torch.cat([old[:start_pos], new[0]]) if start_pos else new[0]  # noqa: E731
        if actx.length:
            keys = [[cat(o, k) for o, k in zip(os_, ks)] for os_, ks in zip(actx.keys, keys)]
            values = [[cat(o, v) for o, v in zip(os_, vs)] for os_, vs in zip(actx.values, values)]
        else:
            keys = [[k[0] for k in ks] for ks in keys]
            values = [[v[0] for v in vs] for vs in values]
        return AdapterContext(keys, values, start_pos + n)

    @torch.inference_mode()
    def predict(self, actx: AdapterContext, tokens: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """Predicted states [B, L, n_idx*H] (target_indices order) of tokens [B, L] at positions
        start_pos..start_pos+L-1 (default: the context length); every row continues the same context (its
        positions < start_pos), causally inside the block. actx is not modified."""
        start_pos = actx.length if start_pos is None else start_pos
        if not 0 <= start_pos <= actx.length:
            raise ValueError(f"block must start within the context 0..{actx.length}, got {start_pos}")
        tokens = tokens.to(self.device).long()
        b, l = tokens.shape
        keys = [[k[:start_pos].expand(b, -1, -1, -1) for k in ks] for ks in actx.keys] if actx.length else None
        values = [[v[:start_pos].expand(b, -1, -1, -1) for v in vs] for vs in actx.values] if actx.length else None
        if keys is None:
            kv, d = self.stages[0][0].kv_heads, self.stages[0][0].head_dim
            empty = torch.zeros(b, 0, kv, d, device=self.device, dtype=self.dtype)
            keys = [[empty for _ in stage] for stage in self.stages]
            values = keys
        causal = torch.ones(l, l, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([torch.ones(l, start_pos, dtype=torch.bool, device=self.device), causal], dim=1)
        positions = torch.arange(start_pos, start_pos + l, device=self.device).expand(b, l)
        outs = self.run_stages(self.embed(tokens), keys, values, positions, mask.expand(b, l, -1))
        return torch.cat(outs, dim=-1)

    @torch.inference_mode()
    def stage_forward(self, stage: int, x: torch.Tensor, ctx_states: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Diagnostic: stage `stage` alone on inputs x [B, L, H] at positions start_pos.., attending causally to
        context keys/values made from ctx_states [T, H] (positions 0..T-1, T >= start_pos). -> [B, L, H]."""
        b, l, _ = x.shape
        ctx = ctx_states[:start_pos].to(self.device, self.dtype)[None]
        cos, sin = self.rope(torch.arange(start_pos, device=self.device)[None])
        kv = [layer.context_kv(ctx, cos, sin) for layer in self.stages[stage]]
        positions = torch.arange(start_pos, start_pos + l, device=self.device).expand(b, l)
        cos, sin = self.rope(positions)
        causal = torch.ones(l, l, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([torch.ones(l, start_pos, dtype=torch.bool, device=self.device), causal], 1).expand(b, l, -1)
        h = x.to(self.device, self.dtype)
        for layer, (k, v) in zip(self.stages[stage], kv):
            h = layer(h, k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), cos, sin, mask)
        return h


def is_adapter_checkpoint(path: str | Path) -> bool:
    return is_checkpoint(path, FORMAT)
