"""A request's logit rules, applied to the target's logits at every position a round verifies.

OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, and vLLM's `repetition_penalty` and
`min_tokens`, change the target's distribution of each next token as a function of the text before it. In a
speculative round, row i of the verify logits decides the token after draft i; it is only ever used when drafts
1..i were accepted, so its rules are applied with those drafts counted as output (`LogitRules.apply`). The
verification rule then sees the distribution plain decoding would have seen at that position, and speculation
changes the speed, never the result. Drafters ignore the rules: a draft the rules make unlikely is rejected like
any other mismatch.

Semantics as vLLM's (the reference OpenAI-compatible server), in its order: `min_tokens` masks the stop tokens
(eos, `stop_token_ids`) while fewer tokens were generated; `logit_bias` is added; `repetition_penalty` divides a
positive logit (multiplies a negative one) of every token in the prompt or the output; `frequency_penalty` times
a token's count in the output and `presence_penalty` if it occurs there are subtracted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol.messages import SamplingParams
from ..spec.sampling import banned_tokens


@dataclass(slots=True)
class LogitRules:
    """The rules of one request (`of`: None when it has none)."""

    bias_ids: torch.Tensor  # [n] token ids with a bias
    bias_values: torch.Tensor  # [n] float32 biases
    presence: float
    frequency: float
    repetition: float
    min_tokens: int
    stop_ids: torch.Tensor  # [m] what min_tokens holds back
    in_prompt: torch.Tensor | None = None  # [p] the prompt's distinct tokens (for the repetition penalty)
    banned: frozenset[int] = frozenset()  # tokens the bias bans: drafts end before them (spec.sampling)

    @classmethod
    def of(cls, sampling: SamplingParams, prompt_ids: list[int], stop_ids: list[int]) -> "LogitRules | None":
        """The rules `sampling` asks for (`stop_ids`: the request's eos and stop token ids)."""
        if not sampling.logit_bias and sampling.presence_penalty == 0 and sampling.frequency_penalty == 0 \
                and sampling.repetition_penalty == 1 and sampling.min_tokens == 0:
            return None
        bias = sorted((int(token), float(value)) for token, value in sampling.logit_bias)
        return cls(bias_ids=torch.tensor([t for t, _ in bias], dtype=torch.long),
                   bias_values=torch.tensor([v for _, v in bias], dtype=torch.float32),
                   presence=sampling.presence_penalty, frequency=sampling.frequency_penalty,
                   repetition=sampling.repetition_penalty, min_tokens=sampling.min_tokens,
                   stop_ids=torch.tensor(sorted(set(stop_ids)), dtype=torch.long),
                   banned=banned_tokens(sampling.logit_bias),
                   in_prompt=None if sampling.repetition_penalty == 1 else torch.unique(torch.tensor(prompt_ids,
                                                                                                    dtype=torch.long)))

    def apply(self, logits: torch.Tensor, output_ids: list[int], draft: list[int]) -> torch.Tensor:
        """logits [len(draft) + 1, vocab] (row i: after `output_ids` + draft[:i]) -> the ruled logits, a new
        tensor of the same shape. The penalties touch only the columns of tokens seen (the output and drafts,
        and the prompt for the repetition penalty), not the whole vocabulary."""
        rows = logits.shape[0]
        out = logits.float().clone()
        held = min(rows, self.min_tokens - len(output_ids))  # the first rows may not stop yet
        if held > 0 and len(self.stop_ids):
            out[:held, self.stop_ids] = float("-inf")
        if len(self.bias_ids):
            out[:, self.bias_ids] += self.bias_values
        if self.repetition == 1 and self.presence == 0 and self.frequency == 0:
            return out
        history = torch.tensor(output_ids + draft[:rows - 1], dtype=torch.long)
        seen = history if self.in_prompt is None else torch.cat([history, self.in_prompt])
        columns = torch.unique(seen)  # [u] sorted: every token a rule may touch
        counts = self._counts(torch.searchsorted(columns, history), len(output_ids), rows, len(columns))  # [rows, u]
        sub = out[:, columns]  # [rows, u]
        if self.repetition != 1:
            repeated = counts > 0
            if self.in_prompt is not None:
                repeated |= torch.isin(columns, self.in_prompt)[None]
            sub = torch.where(repeated, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        out[:, columns] = sub - self.frequency * counts - self.presence * (counts > 0).float()
        return out

    @staticmethod
    def _counts(history: torch.Tensor, committed: int, rows: int, width: int) -> torch.Tensor:
        """[rows, width] float32: row i counts the column indices `history`[:committed + i] (the output, then
        the first i drafts)."""
        base = torch.bincount(history[:committed], minlength=width).float()  # [width]
        steps = torch.zeros(rows, width)  # row i + 1 gains draft i
        if rows > 1:
            steps[torch.arange(1, rows), history[committed:]] = 1.0
        return base[None] + steps.cumsum(0)
