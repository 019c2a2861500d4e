"""A request's grammar (structured output: a JSON schema, any JSON object, a tool call) at every verified position.

The grammar comes compiled by the api (server/structured.py) as an llguidance grammar; here an llguidance matcher
holds its state after the committed output. In a speculative round the block [anchor, d_1..d_gamma] gives rows
0..gamma, and row i decides the token after draft i, so its mask is the grammar's state after the output and
d_1..d_i: the matcher takes the drafts one by one, reading the mask of each row before taking the next draft, and
stops at the first draft its row forbids. That draft has probability 0 under the masked row, so the verification
rejects it there and the rows after it are never used (they are left unmasked). After the verdict the matcher gives
back the drafts that were not accepted and takes the committed token. The masked rows are exactly those plain
decoding would compute, so speculation changes the speed, never the output; drafters ignore the grammar.

A mask costs a small fraction of a verification (measured: docs/journal/2026-12-06-openai-api.md).
"""
from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(RuntimeError):
    """The matcher refused a committed token (it cannot happen while every row is masked: a bug, or a grammar the
    api did not validate)."""


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """The llguidance tokenizer of a Hugging Face one, for masks over the model's `vocab_size` rows (~0.3 s)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)


class GrammarState:
    """One request's grammar: the masks of a block's rows, then the verdict taken in."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        import llguidance
        import llguidance.torch

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"grammar refused: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self.taken = 0  # drafts of the current block the matcher took (tentatively)

    def masks(self, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, vocab] bool: the tokens the grammar allows at each row of a block verifying `draft`
        (rows after the first forbidden draft: all True, never used)."""
        rows = torch.ones(len(draft) + 1, self.vocab_size, dtype=torch.bool)
        self.taken = 0
        for i in range(len(draft) + 1):
            rows[i] = self._allowed()
            if i == len(draft) or not rows[i, draft[i]] or not self.matcher.consume_token(draft[i]):
                break
            self.taken += 1
        return rows

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing more (plain decoding could only add the eos): the request ends."""
        return self.matcher.is_stopped()

    def commit(self, accepted: int, token: int) -> None:
        """The verdict: `accepted` drafts kept (of those `masks` took), then `token`."""
        if self.taken > accepted and not self.matcher.rollback(self.taken - accepted):
            raise GrammarError(f"grammar rollback failed: {self.matcher.get_error()}")
        self.taken = 0
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")

    def _allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next."""
        self._fill(self.matcher, self._bitmask, 0)
        bits = (self._bitmask[0, :, None] >> _BITS) & 1  # [words, 32]
        return bits.reshape(-1)[: self.vocab_size].bool()
