"""Where a new draft model's weights start: random, the target's top layers, or a trained checkpoint.

`target`      draft layer i <- target layer (L - n + i), the last n of the target's L layers: attention and
              MLP projections and both norms (the draft layers' extra q/k norms stay at one). The layers
              then read the projected context instead of the target's residual stream, so this is a start,
              not a copy of the target's behaviour.
`PATH`        a draft-model checkpoint folder (warm start, e.g. domain adaptation of the shipped drafter):
              every weight whose name and shape match is loaded; the vocabulary subset is chosen anew
              from the new data (the LM head rows are the target's, so no trained weight depends on it).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..models.draft_model import WEIGHTS_FILE, DraftModel, is_checkpoint

# draft layer attribute -> target decoder-layer attribute path (Llama / Qwen / Mistral naming)
TARGET_LAYER_MAP = {
    "input_norm.weight": "input_layernorm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
INIT_CHOICES = ("random", "target")


def validate_init(init: str) -> str:
    if init in INIT_CHOICES or is_checkpoint(init):
        return init
    raise ValueError(f"init: {init!r} is neither one of {INIT_CHOICES} nor a draft-model checkpoint folder")


def initialise(model: DraftModel, target, init: str) -> dict:
    """Apply `init` to a freshly built model in place; returns what was loaded (for the run's report)."""
    if init == "random":
        return {"init": "random"}
    if init == "target":
        return _from_target_layers(model, target)
    return _from_checkpoint(model, Path(init))


@torch.no_grad()
def _from_target_layers(model: DraftModel, target) -> dict:
    layers = target.model.layers
    first = len(layers) - len(model.layers)
    copied = 0
    for i, draft_layer in enumerate(model.layers):
        source = dict(layers[first + i].named_parameters())
        own = dict(draft_layer.named_parameters())
        for mine, theirs in TARGET_LAYER_MAP.items():
            if theirs in source and own[mine].shape == source[theirs].shape:
                own[mine].copy_(source[theirs].float())
                copied += 1
    return {"init": "target", "target_layers": list(range(first, len(layers))), "tensors": copied}


@torch.no_grad()
def _from_checkpoint(model: DraftModel, path: Path) -> dict:
    tensors = load_file(str(path / WEIGHTS_FILE))
    tensors.pop("vocab_subset", None)
    own = dict(model.named_parameters())
    loaded = [k for k, v in tensors.items() if k in own and own[k].shape == v.shape]
    for k in loaded:
        own[k].copy_(tensors[k].float())
    fresh = sorted(set(own) - set(loaded))
    return {"init": str(path), "tensors": len(loaded), "fresh": fresh}


__all__ = ["initialise", "validate_init", "INIT_CHOICES"]
