"""Rolling back linear-attention (Gated DeltaNet) layers of hybrid targets (Qwen3.5, Qwen3-Next).

Their conv and recurrent states are updated in place and cannot be cropped. Before a verify forward we
clone those states and capture each mixer's input; once k of the L fed positions are accepted we restore
the clones and replay only the mixer over the k kept inputs — the GDN projections for k tokens, not a
second target forward. Full-attention layers of the same cache are cropped as usual.

`committed` copies the states of chosen layers out of a request's cache: the snapshot the drafter's
foresight decoder continues from (protocol `LinearStates`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LinearSnapshot:
    states: dict[int, tuple[dict, dict]]  # layer -> (conv_states, recurrent_states) clones
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its position count (transformers >= 5.25)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, L, hidden] mixer input
    fed: int = 0  # positions fed by the verify forward


class LinearStateRollback:
    def __init__(self, model):
        layers = model.model.layers
        self.linear = {i: layer.linear_attn for i, layer in enumerate(layers) if hasattr(layer, "linear_attn")}

    def __bool__(self) -> bool:
        return bool(self.linear)

    def begin(self, cache) -> tuple[LinearSnapshot, list]:
        """Clone the linear layers' states and hook their mixers to capture this forward's inputs."""
        snap = LinearSnapshot(states={i: (_clone(cache.layers[i].conv_states), _clone(cache.layers[i].recurrent_states))
                                      for i in self.linear},
                              counts={i: cache.layers[i].cumulative_length_linear.clone() for i in self.linear
                                      if hasattr(cache.layers[i], "cumulative_length_linear")})
        handles = [mixer.register_forward_pre_hook(_capture(snap, i), with_kwargs=True)
                   for i, mixer in self.linear.items()]
        return snap, handles

    def check_layers(self, layers: list[int]) -> None:
        bad = [i for i in layers if i not in self.linear]
        if bad or layers != sorted(set(layers)):
            raise ValueError(f"linear-state layers must be distinct ascending linear-attention layers "
                             f"{sorted(self.linear)}, got {layers}")

    @torch.inference_mode()
    def committed(self, cache, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv [n, conv_dim, kernel] and recurrent [n, v_heads, k_dim, v_dim] states of `layers`
        (batch row 0): the cache updates its own in place, so the copies must not alias them."""
        conv = torch.stack([cache.layers[i].conv_states[0][0] for i in layers])
        recurrent = torch.stack([cache.layers[i].recurrent_states[0][0] for i in layers])
        return conv, recurrent

    @torch.inference_mode()
    def rollback(self, cache, snap: LinearSnapshot, rejected: int) -> None:
        """Keep the first `snap.fed - rejected` fed positions in every layer of `cache`."""
        keep = snap.fed - rejected
        for i, layer in enumerate(cache.layers):
            if i in self.linear:
                conv, rec = snap.states[i]
                _restore(layer.conv_states, conv)
                _restore(layer.recurrent_states, rec)
                if i in snap.counts:  # the replay below counts the kept positions again
                    layer.cumulative_length_linear.copy_(snap.counts[i])
                self.linear[i](hidden_states=snap.inputs[i][:, :keep], cache=cache)
            else:
                layer.crop(-rejected)


def _clone(states: dict) -> dict:
    return {k: (v.clone() if v is not None else None) for k, v in states.items()}


def _restore(states: dict, saved: dict) -> None:
    for k, v in saved.items():
        if v is not None:
            states[k].copy_(v)


def _capture(snap: LinearSnapshot, layer: int):
    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        snap.inputs[layer] = hidden.detach()
        snap.fed = hidden.shape[1]

    return hook
