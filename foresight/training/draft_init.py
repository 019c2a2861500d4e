"""Where a new draft model's weights start: random, the target's top layers, or a trained checkpoint.

`target`      draft layer i <- the i-th of the target's top n softmax-attention layers (n = the draft's
              layers; on Llama / Qwen3 / Gemma these are simply the last n layers): attention and MLP
              projections and the four norms. The layers then read the projected context instead of the
              target's residual stream, so this is a start, not a copy of the target's behaviour.
              Hybrid targets (Qwen3.5, Qwen3-Next: Gated DeltaNet layers with a full-attention layer
              every 4th) give their top n FULL-attention layers, skipping the linear-attention ones, which
              have no q/k/v/o to copy; a target with fewer than n of them is refused (a ValueError naming
              --init and --layers), rather than leaving some draft layers half initialised. Their gated
              attention's q_proj holds query and output-gate rows per head: the query rows are copied, the
              gate is dropped (the draft layer has none). A mixture-of-experts MLP (Qwen3-Next) has no
              dense gate/up/down projections: the draft MLP stays random (listed under "skipped").
              Norm weights are copied as the scale they apply: Gemma, Qwen3.5 and Qwen3-Next store
              RMSNorm weights zero-centred (x * (1 + w)); the draft's norms are plain (x * w).
`PATH`        a draft-model checkpoint folder (warm start, e.g. domain adaptation of the shipped drafter):
              every weight whose name and shape match is loaded; the vocabulary subset is chosen anew
              from the new data (the LM head rows are the target's, so no trained weight depends on it).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..models.draft_model import WEIGHTS_FILE, DraftConfig, DraftModel, is_checkpoint

# draft layer weight -> target decoder-layer weight (Llama / Qwen / Mistral / Gemma naming)
TARGET_LAYER_MAP = {
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
# draft RMSNorm -> target norm module, the first that exists (copied as the scale it applies, see _norm_scale)
TARGET_NORM_MAP = {
    "input_norm": ("input_layernorm",),
    # the norm before the MLP: Gemma's post_attention_layernorm normalises the attention's output instead
    "post_norm": ("pre_feedforward_layernorm", "post_attention_layernorm"),
    "q_norm": ("self_attn.q_norm",),  # Qwen3, Gemma3, Qwen3.5, Qwen3-Next (absent on Llama: stays at one)
    "k_norm": ("self_attn.k_norm",),
}
INIT_CHOICES = ("random", "target")


def validate_init(init: str, target=None, num_layers: int | None = None) -> str:
    """`init` if it names a start; with the target and the draft's layer count, also refuses `target`
    where the target has too few attention layers to give (before any labelling is spent)."""
    if init not in INIT_CHOICES and not is_checkpoint(init):
        raise ValueError(f"init: {init!r} is neither one of {INIT_CHOICES} nor a draft-model checkpoint folder")
    if init == "target" and target is not None and num_layers is not None:
        source_layers(target, num_layers)
    return init


def initialise(model: DraftModel, target, init: str) -> dict:
    """Apply `init` to a freshly built model in place; returns what was loaded (for the run's report)."""
    if init == "random":
        return {"init": "random"}
    if init == "target":
        return _from_target_layers(model, target)
    return _from_checkpoint(model, Path(init))


def attention_layers(target) -> list[int]:
    """Indices of the target's decoder layers with softmax attention (`self_attn`): all of them on Llama /
    Qwen3 / Gemma, the full-attention ones of a hybrid (its Gated DeltaNet layers have `linear_attn`)."""
    types = getattr(target.config, "layer_types", None) or []
    return [i for i, layer in enumerate(target.model.layers)
            if getattr(layer, "self_attn", None) is not None and (i >= len(types) or types[i] != "linear_attention")]


def source_layers(target, n: int) -> list[int]:
    """The target layers the n draft layers start from: its top n attention layers, in order."""
    found = attention_layers(target)
    if len(found) < n:
        total = len(target.model.layers)
        raise ValueError(f"--init target: the draft model has {n} layers but the target has only {len(found)} "
                         f"(softmax) attention layers of {total} ({found}; the others are linear attention, "
                         f"nothing to copy into a draft layer): use --layers {len(found)} or fewer, or --init random")
    return found[len(found) - n:]


@torch.no_grad()
def _from_target_layers(model: DraftModel, target) -> dict:
    picked = source_layers(target, len(model.layers))
    copied, skipped = 0, []
    for i, (draft_layer, index) in enumerate(zip(model.layers, picked)):
        layer = target.model.layers[index]
        source = dict(layer.named_parameters())
        own = dict(draft_layer.named_parameters())
        for mine, theirs in TARGET_LAYER_MAP.items():
            weight = source.get(theirs)
            if weight is not None and mine == "q_proj.weight":
                weight = _query_rows(layer.self_attn, weight)
            if weight is not None and own[mine].shape == weight.shape:
                own[mine].copy_(weight.float())
                copied += 1
            else:
                skipped.append(f"layers.{i}.{mine}")
        for mine, theirs in TARGET_NORM_MAP.items():
            norm = next((m for m in (_submodule(layer, name) for name in theirs) if m is not None), None)
            scale = _norm_scale(norm) if norm is not None else None
            if scale is not None and getattr(draft_layer, mine).weight.shape == scale.shape:
                getattr(draft_layer, mine).weight.copy_(scale)
                copied += 1
            else:
                skipped.append(f"layers.{i}.{mine}.weight")
    return {"init": "target", "target_layers": picked, "tensors": copied, "skipped": skipped}


def _query_rows(attn, weight: torch.Tensor) -> torch.Tensor:
    """q_proj rows that make the queries. Gated attention (Qwen3.5, Qwen3-Next) projects per head
    [query (head_dim) | output gate (head_dim)], so its q_proj has twice the rows o_proj reads: keep the
    query half of each head."""
    o_proj = getattr(attn, "o_proj", None)
    head_dim = getattr(attn, "head_dim", None)
    if o_proj is None or not head_dim or weight.shape[0] != 2 * o_proj.weight.shape[1]:
        return weight
    return weight.view(-1, 2 * head_dim, weight.shape[1])[:, :head_dim].reshape(-1, weight.shape[1])


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _norm_scale(norm: torch.nn.Module) -> torch.Tensor | None:
    """The per-channel scale a target RMSNorm applies, whatever it stores (w, or 1 + w for the zero-centred
    norms of Gemma / Qwen3.5 / Qwen3-Next): its output on a constant input, which RMS-normalises to ones
    (a large constant, so that eps does not matter)."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1:
        return None
    ones = torch.full((1, weight.shape[0]), 1e3, dtype=weight.dtype, device=weight.device)
    return norm(ones)[0].float()


@torch.no_grad()
def _from_checkpoint(model: DraftModel, path: Path) -> dict:
    tensors = load_file(str(path / WEIGHTS_FILE))
    tensors.pop("vocab_subset", None)
    own = dict(model.named_parameters())
    loaded = [k for k, v in tensors.items() if k in own and own[k].shape == v.shape]
    for k in loaded:
        own[k].copy_(tensors[k].float())
    fresh = sorted(set(own) - set(loaded))
    # The Jacobi passes the checkpoint serves with were chosen by measuring it served; a fine-tune keeps them.
    model.config.default_passes = DraftConfig.read(path).default_passes
    return {"init": str(path), "tensors": len(loaded), "fresh": fresh}


__all__ = ["initialise", "validate_init", "attention_layers", "source_layers", "INIT_CHOICES"]
