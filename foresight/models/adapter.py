"""The hidden-to-hidden adapter of foresight drafting (JetSpec++ section 4.2; docs/architecture.md).

In one parallel pass it predicts the target's hidden states at `target_indices` (hidden-state index i =
raw output of decoder layer i-1, the residual stream, NOT normed; default for a 30-layer target 3, 15, 27)
for the gamma+1 positions of a block [y0, d_1..d_gamma] whose tokens are known, given the TRUE cached
states of the verified context at those same indices.

    stage s (one per index l = target_indices[s], ascending): a short stack of transformer layers,
        initialised as copies of the target layers just below l (l-1, or l-2 and l-1).
        input   the prediction of the stage below (the target's shared token embeddings, index 0, at the bottom)
        context every attention layer of the stage attends to keys/values made by ITS OWN input norm + k/v
                projections (RoPE at the true positions) from the TRUE context states at index l; a linear-
                attention layer continues the state ITS OWN input norm + mixer reach over those states; cached
                per request and extended incrementally (`AdapterContext`)
        block   causal inside the block; queries/keys at the block's true positions
        output  the predicted residual-stream states at index l (the input of the next stage)

Why the context is read at index l and not at l-1 (the input of the copied layer l-1): the target ships,
and the labelled data stores, only the indices the draft model reads ([3, 15, 27, 30]); l-1 is not among
them, and the paper's adapter attends to the cached prefix at layer l (h^l_{<n}). Index l is one layer away
from what the copied layer saw in the target; training absorbs that mismatch.

What the initialisation makes exact (tests/unit/test_adapter.py): a 1-layer stage copied from target layer
l-1, given the TRUE block states at index l-1 as input and its context (keys/values, or a linear layer's
state) computed from the TRUE context states at index l-1, reproduces the target's index-l states exactly
(it IS target layer l-1, run by hand). Hence with consecutive indices (l- = l-1, embeddings at the bottom for
l=1) and the context slots filled with the index-(l-1) states, `predict` reproduces the target exactly. With
the served inputs (context at index l, inputs from the stage below at l- < l-1) it is only an initialisation.

Supported targets (`ADAPTER_MODEL_TYPES`): Llama-structured full-attention models (llama, qwen3) and the
hybrids Qwen3.5 / Qwen3-Next, whose layers are mostly Gated DeltaNet (linear attention) with gated full
attention every 4th layer (the layer classes: foresight/models/adapter_layers.py). A stage's layer is a copy
of its target layer whatever the kind; states are read and predicted at a linear-attention layer's index as
at an attention layer's. Its context is the layer's committed state: the (causal-conv, recurrent) state its
own (copied, then trained) input norm + mixer reach over the TRUE context states at index l -- the same
recipe as an attention layer's context keys/values. A block runs causally from a copy of it. A recurrence
keeps only its state after the last position, so with linear-attention layers the context grows only at its
end (`extend_context` at start_pos = length, `predict` from length: what the foresight drafter does) and a
rollback raises ValueError (per-position states would cost a recurrent state per position and layer).
RoPE comes from the target's inverse frequencies: with partial rotary (Qwen3.5 / Next: a quarter of head_dim)
cos/sin cover the rotary dims only, and Qwen3.5's multimodal RoPE is plain RoPE at text positions.

Serving keeps one `AdapterContext` per request. `predict_many` predicts the blocks of several requests in
one pass (the foresight drafter's batch): their context keys/values right-padded to the longest and
masked, each row at its own positions, linear-attention layers starting from each row's own state.
With `--drafter-compile` a block of one row and a context's extension run as compiled graphs
(models/compiled_adapter.py).

The checkpoint is a folder (config.json + model.safetensors, fp16); the token embedding and the RoPE
frequencies come from the target at load time and are never stored.
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

from .adapter_layers import AdapterLayer, LinearAdapterLayer, block_layout
from .draft_model import SharedWeights, default_target_layers, is_checkpoint

FORMAT = "foresight-adapter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

__all__ = ["ADAPTER_MODEL_TYPES", "AdapterConfig", "Adapter", "AdapterContext", "default_adapter_indices",
           "is_adapter_checkpoint"]

ADAPTER_MODEL_TYPES = ("llama", "qwen3", "qwen3_5_text", "qwen3_next")  # Qwen3.5 text model: qwen3_5_text
LAYER_CLASSES = {"full_attention": AdapterLayer, "linear_attention": LinearAdapterLayer}


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
    # layers over the index-27 one (docs/journal/2026-11-29-first-measurements.md, "Decoder depth").
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

    @classmethod
    def read(cls, folder: str | Path) -> "AdapterConfig":
        """The config of the checkpoint folder `folder`."""
        return cls.from_dict(json.loads((Path(folder) / CONFIG_FILE).read_text()))

    def write(self, folder: str | Path) -> None:
        """Into the checkpoint folder `folder`, replacing its config at once (never half written)."""
        tmp = Path(folder) / (CONFIG_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(Path(folder) / CONFIG_FILE)


@dataclass(slots=True)
class AdapterContext:
    """One request's verified context, positions 0..length-1, per stage, per layer: an attention layer's
    keys/values [T, kv_heads, head_dim] (RoPE applied); a linear-attention layer's `states` (conv
    [conv_dim, kernel], recurrent [v_heads, k_dim, v_dim]) after position length-1 (None before position 0).
    A layer's slots in the other lists hold None; `states` is empty for an adapter without linear layers.
    Never modified in place: `extend_context` returns a new one."""

    keys: list[list[torch.Tensor | None]] = field(default_factory=list)
    values: list[list[torch.Tensor | None]] = field(default_factory=list)
    length: int = 0
    states: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=list)

    def __len__(self) -> int:
        return self.length


class Adapter(nn.Module):
    def __init__(self, config: AdapterConfig, target_model):
        super().__init__()
        tcfg = target_model.config.get_text_config(decoder=True)
        if getattr(tcfg, "model_type", None) not in ADAPTER_MODEL_TYPES:
            raise NotImplementedError(f"adapter supports model types {ADAPTER_MODEL_TYPES}, got {tcfg.model_type!r}")
        layer_types = getattr(tcfg, "layer_types", None) or ["full_attention"] * tcfg.num_hidden_layers
        kinds = [[layer_types[i] for i in stage] for stage in config.stage_layers]
        if any(kind not in LAYER_CLASSES for stage in kinds for kind in stage):
            raise NotImplementedError(f"adapter supports {sorted(LAYER_CLASSES)} layers, its stages copy {kinds}")
        if tcfg.hidden_size != config.hidden_size or tcfg.num_hidden_layers != config.num_target_layers:
            raise ValueError("adapter config does not match the target model")
        self.config = config
        layers = target_model.model.layers
        self.stages = nn.ModuleList(nn.ModuleList(LAYER_CLASSES[kind](layers[i]) for i, kind in zip(stage, ks))
                                    for stage, ks in zip(config.stage_layers, kinds))
        # RoPE tables from the target's inverse frequencies (incl. any rope-type rescaling), kept as a plain
        # float32 attribute: a buffer would be cast by .to(fp16), and fp16 angles are wrong at long positions.
        rot = target_model.model.rotary_emb
        self._inv_freq = rot.inv_freq.detach().float().cpu().clone()
        self._rope_scaling = float(rot.attention_scaling)
        shared = SharedWeights.from_target(target_model)
        self.register_buffer("embed_weight", shared.embed_weight, persistent=False)  # shared, frozen, not stored
        self.embed_scale = shared.embed_scale
        self.compiled = None  # the compiled prediction of one request's block (models/compiled_adapter.py), if built

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
        self.config.write(path)

    @classmethod
    def load(cls, path: str | Path, target_model, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "Adapter":
        path = Path(path)
        cfg = AdapterConfig.read(path)
        model = cls(cfg, target_model)
        model.load_state_dict({k: v.float() for k, v in load_file(str(path / WEIGHTS_FILE)).items()}, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def deepened(self, target_model, extra: int) -> "Adapter":
        """A copy with `extra` more layers in the top stage, below its trained ones: copies of the target layers
        just below those, each started as the identity (`start_as_identity`), so the copy predicts exactly
        what this adapter does until training moves them. The top index is the one a short foresight decoder
        reads; one trained layer bridging the index below to it is too shallow (docs/journal/2026-12-03-deeper-adapter.md)."""
        top = self.config.stage_layers[-1]
        if extra < 1 or top[0] - extra < 0:
            raise ValueError(f"cannot add {extra} layers below target layer {top[0]} (the top stage's first)")
        new_top = list(range(top[0] - extra, top[0])) + list(top)
        cfg = dataclasses.replace(self.config, stage_layers=[*self.config.stage_layers[:-1], new_top],
                                  extra=dict(self.config.extra))
        model = Adapter(cfg, target_model).to(device=self.device, dtype=self.dtype)
        for layer in model.stages[-1][:extra]:
            layer.start_as_identity()
        for s, stage in enumerate(self.stages):
            offset = extra if s == len(self.stages) - 1 else 0
            for j, layer in enumerate(stage):
                model.stages[s][j + offset].load_state_dict(layer.state_dict())
        return model

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

    @property
    def has_linear(self) -> bool:
        """Whether a stage holds a linear-attention layer (its context is a state, not keys/values)."""
        return any(isinstance(layer, LinearAdapterLayer) for stage in self.stages for layer in stage)

    def rope(self, positions: torch.Tensor):
        """positions [G, S] -> cos, sin [G, S, r] in the model dtype (angles in float32, as the target does);
        r = the rotary dims of a head (head_dim, or its first part with partial RoPE)."""
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
        """states [G, T, n_idx*H] true context states at positions [G, T] -> per stage, per layer k, v lists
        (None for a linear-attention layer)."""
        cos, sin = self.rope(positions)
        keys, values = [], []
        for stage, h in zip(self.stages, self.split(states)):
            kv = [(None, None) if isinstance(layer, LinearAdapterLayer) else layer.context_kv(h, cos, sin)
                  for layer in stage]
            keys.append([k for k, _ in kv])
            values.append([v for _, v in kv])
        return keys, values

    def run_stages(self, x, keys, values, positions, mask, states=None, blocks: int = 1) -> list[torch.Tensor]:
        """x [G, Q, H] bottom input (embeddings); keys/values per stage per layer [G, T, kv, d]; positions [G, Q];
        mask [G, Q, T+Q]; states per stage per layer: a linear-attention layer's state before each block
        (conv, recurrent [G*blocks, ...], None = before position 0), each row holding `blocks` equal contiguous
        blocks. Each stage reads the previous stage's prediction. Returns per index [G, Q, H]."""
        cos, sin = self.rope(positions)
        outs = []
        for s, (stage, ks, vs) in enumerate(zip(self.stages, keys, values)):
            for j, (layer, k, v) in enumerate(zip(stage, ks, vs)):
                if isinstance(layer, LinearAdapterLayer):
                    g, q, h = x.shape
                    x = layer(x.reshape(g * blocks, q // blocks, h), states[s][j]).reshape(g, q, h)
                else:
                    x = layer(x, k, v, cos, sin, mask)
            outs.append(x)
        return outs

    # ------------------------------------------------------------------ training: many blocks per context

    def forward_blocks(self, ctx_states, tokens, positions, mask) -> torch.Tensor:
        """ctx_states [G, T, n_idx*H] true states of positions 0..T-1 (zero-padded rows are masked out);
        tokens/positions [G, Q] (any number of blocks per row); mask [G, Q, T+Q] bool. With linear-attention
        layers the mask must be sample_adapter_blocks' layout (equal contiguous blocks, each seeing a context
        prefix; `block_layout`): their per-block start states come from running over the context in segments.
        Returns the predictions [G, Q, n_idx*H] (target_indices order)."""
        g, t = ctx_states.shape[:2]
        ctx_pos = torch.arange(t, device=tokens.device).expand(g, t)
        keys, values = self.context_kv(ctx_states, ctx_pos)
        states, blocks = None, 1
        if self.has_linear:
            ctx_lens, blocks = block_layout(mask, t)  # [G, A]
            states = [[layer.block_start_states(h, ctx_lens) if isinstance(layer, LinearAdapterLayer) else None
                       for layer in stage] for stage, h in zip(self.stages, self.split(ctx_states))]
        return torch.cat(self.run_stages(self.embed(tokens), keys, values, positions, mask, states, blocks), dim=-1)

    # ------------------------------------------------------------------ inference: cached context per request

    def new_context(self) -> AdapterContext:
        if not self.has_linear:
            return AdapterContext([[] for _ in self.stages], [[] for _ in self.stages], 0)
        nones = lambda: [[None] * len(stage) for stage in self.stages]  # noqa: E731
        return AdapterContext(nones(), nones(), 0, nones())

    def _check_end(self, actx: AdapterContext, start_pos: int, what: str) -> None:
        if start_pos != actx.length and self.has_linear:
            raise ValueError(f"{what} at {start_pos}: a linear-attention layer holds only its state after the "
                             f"context's last position ({actx.length - 1}), it cannot restart earlier")

    @torch.inference_mode()
    def extend_context(self, actx: AdapterContext, states: torch.Tensor, start_pos: int) -> AdapterContext:
        """A new context = actx's positions < start_pos + `states` [n, n_idx*H] (true states, target_indices order)
        at positions start_pos..start_pos+n-1. start_pos may lie before the end (the tail is replaced, e.g. a
        rollback; not with linear-attention layers) but not after it. actx itself is not modified, so contexts
        can branch."""
        if not 0 <= start_pos <= actx.length:
            raise ValueError(f"context holds positions 0..{actx.length - 1}; cannot extend at {start_pos}")
        self._check_end(actx, start_pos, "cannot extend the context")
        n = states.shape[0]
        states = states.to(self.device)[None]
        positions = torch.arange(start_pos, start_pos + n, device=self.device)[None]
        compiled = self.compiled.context_kv(states, positions) if self.compiled is not None else None
        keys, values = compiled if compiled is not None else self.context_kv(states, positions)
        cat = lambda old, new: (None if new is None  # noqa: E731
                                else torch.cat([old[:start_pos], new[0]]) if start_pos else new[0])
        if actx.length:
            keys = [[cat(o, k) for o, k in zip(os_, ks)] for os_, ks in zip(actx.keys, keys)]
            values = [[cat(o, v) for o, v in zip(os_, vs)] for os_, vs in zip(actx.values, values)]
        else:
            keys = [[cat(None, k) for k in ks] for ks in keys]
            values = [[cat(None, v) for v in vs] for vs in values]
        committed = []
        if self.has_linear:
            for stage, h, olds in zip(self.stages, self.split(states), actx.states):
                news = [layer.context_state(h, _rows(old, 1)) if isinstance(layer, LinearAdapterLayer) else None
                        for layer, old in zip(stage, olds)]
                committed.append([None if st is None else (st[0][0], st[1][0]) for st in news])
        return AdapterContext(keys, values, start_pos + n, committed)

    def _block_context(self, actxs: list[AdapterContext], starts: list[int]):
        """Per stage, per layer: context keys/values [G, T, kv, d] (T = max(starts); row g holds actxs[g]'s
        positions < starts[g], zeros after them) and linear-attention states (copies, [G, ...]; None when no
        row has a state) for rows that continue actxs[g] at starts[g]; and ctx_mask [G, T] (True = a real
        context position). Rows over one context at one start share it (views, no padding)."""
        g, t = len(actxs), max(starts)
        shared = all(a is actxs[0] for a in actxs) and len(set(starts)) == 1
        keys, values, states = [], [], []
        for s, stage in enumerate(self.stages):
            ks, vs, sts = [], [], []
            for j, layer in enumerate(stage):
                k = v = st = None
                if isinstance(layer, LinearAdapterLayer):
                    st = _rows(actxs[0].states[s][j], g) if shared else self._stack_states(layer, actxs, s, j)
                elif shared and t:
                    k = actxs[0].keys[s][j][:t].expand(g, -1, -1, -1)
                    v = actxs[0].values[s][j][:t].expand(g, -1, -1, -1)
                else:
                    k = torch.zeros(g, t, layer.kv_heads, layer.head_dim, device=self.device, dtype=self.dtype)
                    v = torch.zeros_like(k)  # masked columns must hold finite numbers
                    for r, (a, n) in enumerate(zip(actxs, starts)):
                        if n:
                            k[r, :n], v[r, :n] = a.keys[s][j][:n], a.values[s][j][:n]
                ks.append(k)
                vs.append(v)
                sts.append(st)
            keys.append(ks)
            values.append(vs)
            states.append(sts)
        ctx_mask = torch.arange(t, device=self.device) < torch.tensor(starts, device=self.device)[:, None]
        return keys, values, states, ctx_mask

    def _stack_states(self, layer: LinearAdapterLayer, actxs: list[AdapterContext], s: int, j: int):
        """The committed states of stage s, layer j of every row's context, stacked (copies): conv
        [G, conv_dim, kernel], recurrent [G, v_heads, k_dim, v_dim]. A context without one (no position
        yet) starts from zeros, which the mixer treats as no past; None when no row has a state."""
        rows = [a.states[s][j] for a in actxs]
        if all(st is None for st in rows):
            return None
        like = self.embed_weight.new_empty(0, dtype=self.dtype)
        rows = [layer.zero_state(1, like) if st is None else _rows(st, 1) for st in rows]
        return torch.cat([c for c, _ in rows]), torch.cat([r for _, r in rows])

    @torch.inference_mode()
    def predict(self, actx: AdapterContext, tokens: torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """Predicted states [B, L, n_idx*H] (target_indices order) of tokens [B, L] at positions
        start_pos..start_pos+L-1 (default: the context length; with linear-attention layers it must be); every
        row continues the same context (its positions < start_pos), causally inside the block. actx is not
        modified."""
        b = tokens.shape[0]
        return self.predict_many([actx] * b, tokens, None if start_pos is None else [start_pos] * b)

    @torch.inference_mode()
    def predict_many(self, actxs: list[AdapterContext], tokens: torch.Tensor,
                     starts: list[int] | None = None) -> torch.Tensor:
        """`predict` with a context per row, in one pass: row g of tokens [G, L] continues actxs[g] at
        positions starts[g]..starts[g]+L-1 (default: each context's length; with linear-attention layers it
        must be). Contexts of different lengths are right-padded to the longest and masked ([G, L, T+L]);
        linear-attention layers start each row from its own context's state. Rows may share a context.
        -> [G, L, n_idx*H]; row g equals `predict(actxs[g], tokens[g:g+1], starts[g])` up to float rounding."""
        starts = [a.length for a in actxs] if starts is None else [int(s) for s in starts]
        if len(starts) != len(actxs) or len(actxs) != tokens.shape[0]:
            raise ValueError(f"one context and start per row: {len(actxs)} contexts, {len(starts)} starts, "
                             f"{tokens.shape[0]} rows")
        for actx, start_pos in zip(actxs, starts):
            if not 0 <= start_pos <= actx.length:
                raise ValueError(f"block must start within the context 0..{actx.length}, got {start_pos}")
            self._check_end(actx, start_pos, "cannot predict a block")
        tokens = tokens.to(self.device).long()
        g, l = tokens.shape
        if self.compiled is not None and self.compiled.takes(g, l, starts[0]):
            return self.compiled.run(actxs[0], tokens, starts[0])
        keys, values, states, ctx_mask = self._block_context(actxs, starts)  # ctx_mask [G, T]
        causal = torch.ones(l, l, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([ctx_mask[:, None, :].expand(g, l, -1), causal.expand(g, l, l)], dim=2)  # [G, L, T+L]
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(l, device=self.device)  # [G, L]
        outs = self.run_stages(self.embed(tokens), keys, values, positions, mask, states)
        return torch.cat(outs, dim=-1)

    @torch.inference_mode()
    def stage_forward(self, stage: int, x: torch.Tensor, ctx_states: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Diagnostic: stage `stage` alone on inputs x [B, L, H] at positions start_pos.., causally continuing
        the context made from ctx_states [T, H] (positions 0..T-1, T >= start_pos). -> [B, L, H]."""
        b, l, _ = x.shape
        ctx = ctx_states[:start_pos].to(self.device, self.dtype)[None]
        cos, sin = self.rope(torch.arange(start_pos, device=self.device)[None])
        ctxs = [layer.context_state(ctx) if isinstance(layer, LinearAdapterLayer) else layer.context_kv(ctx, cos, sin)
                for layer in self.stages[stage]]
        positions = torch.arange(start_pos, start_pos + l, device=self.device).expand(b, l)
        cos, sin = self.rope(positions)
        causal = torch.ones(l, l, dtype=torch.bool, device=self.device).tril()
        mask = torch.cat([torch.ones(l, start_pos, dtype=torch.bool, device=self.device), causal], 1).expand(b, l, -1)
        h = x.to(self.device, self.dtype)
        for layer, c in zip(self.stages[stage], ctxs):
            if isinstance(layer, LinearAdapterLayer):
                h = layer(h, None if c is None else _rows((c[0][0], c[1][0]), b))
            else:
                h = layer(h, c[0].expand(b, -1, -1, -1), c[1].expand(b, -1, -1, -1), cos, sin, mask)
        return h


def _rows(state, b: int):
    """A committed state (conv [conv_dim, kernel], recurrent [v_heads, k_dim, v_dim]) or None -> a copy for b
    rows ([b, ...] each; None stays None). Copies: no kernel can then write into the context."""
    return None if state is None else tuple(t.expand(b, *t.shape).clone() for t in state)


def is_adapter_checkpoint(path: str | Path) -> bool:
    return is_checkpoint(path, FORMAT)
