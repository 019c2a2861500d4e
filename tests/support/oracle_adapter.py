"""A test-only 'perfect adapter': predicts the TRUE target states of a block (JetSpec++'s upper bound).

It implements the adapter interface the foresight drafter codes against:

    target_indices                        hidden_states indices it predicts (ascending)
    new_context() -> actx
    extend_context(actx, states[n, len(target_indices)*H], start_pos) -> actx
    predict(actx, tokens[B, L], start_pos) -> [B, L, len(target_indices)*H]

The interface passes states, never tokens, so the oracle is told the sequences it will be asked about
(`sequences`: each request's prompt + its greedy continuation; at temperature 0 the committed tokens
are exactly these, since verification is lossless). The first context chunk (the prompt's states)
identifies the sequence; every chunk received is checked against the target's true states at those
positions, which catches column-slicing and position bookkeeping errors in the drafter. `predict` runs
the whole target over the sequence's committed prefix + the given tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class OracleContext:
    seq: int | None = None  # which of the known sequences
    length: int = 0  # positions received (0..length-1)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (start, n) of each extend


class OracleAdapter:
    def __init__(self, model, target_indices: list[int], sequences: list[list[int]], atol: float = 1e-4):
        self.model = model
        self.target_indices = sorted(target_indices)
        self.sequences = [list(s) for s in sequences]
        self.atol = atol
        self.predict_calls = 0
        self._truth = [self.true_states(s) for s in self.sequences]  # [T, len(indices)*H] each

    @torch.inference_mode()
    def true_states(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """[..., T] tokens -> [..., T, len(target_indices)*H] at target_indices."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        squeeze = ids.dim() == 1
        out = self.model(ids[None] if squeeze else ids, output_hidden_states=True)
        states = torch.cat([out.hidden_states[i] for i in self.target_indices], dim=-1)
        return states[0] if squeeze else states

    def new_context(self) -> OracleContext:
        return OracleContext()

    def extend_context(self, actx: OracleContext, states: torch.Tensor, start_pos: int) -> OracleContext:
        assert start_pos == actx.length, f"context gap: have {actx.length}, got states from {start_pos}"
        n = states.shape[0]
        if actx.seq is None:
            matches = [i for i, t in enumerate(self._truth)
                       if t.shape[0] >= n and torch.allclose(t[:n], states.float(), atol=self.atol, rtol=0)]
            assert matches, "the prompt's states match none of the known sequences"
            actx.seq = matches[0]
        truth = self._truth[actx.seq][start_pos:start_pos + n]
        torch.testing.assert_close(states.float(), truth, atol=self.atol, rtol=0)
        actx.length += n
        actx.chunks.append((start_pos, n))
        return actx

    def predict(self, actx: OracleContext, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        self.predict_calls += 1
        assert start_pos == actx.length, f"predicting from {start_pos}, context holds {actx.length}"
        prefix = torch.tensor(self.sequences[actx.seq][:start_pos], dtype=torch.long)
        ids = torch.cat([prefix.expand(tokens.shape[0], -1), tokens.long()], dim=1)
        return self.true_states(ids)[:, start_pos:]

    def truncate(self, deepest_index: int) -> "OracleAdapter":
        """As Adapter.truncate: predict only the indices up to `deepest_index` from now on."""
        self.target_indices = [i for i in self.target_indices if i <= deepest_index]
        self._truth = [self.true_states(s) for s in self.sequences]
        return self
