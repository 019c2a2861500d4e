"""Self-refinement of pre-drafted blocks (JetSpec++ section 4.3): context refresh and anchor replacement.

One outcome row: the block under verification is [y0, d_1..d_gamma] with y0 at position n; outcome
(k, a) puts the anchor a at n+k+1 and its draft x_1..x_m at n+k+2..n+k+1+m.

    refresh     the adapter re-predicts the states of [y0, d_1..d_k, a, x_1..x_m] from position n over the
                TRUE context (all rows in one call, right-padded: it is causal), and the decoder gives its
                argmax at every position; the row of x_{i-1} (of a, for i = 1) is its guess of x_i.
    replacement the first not yet fixed position i whose guess differs from x_i: x_1..x_{i-1} are fixed for
                the rest of the round, x_i := the guess and fixed too ("anchor"), or only x_1..x_{i-1} are
                fixed ("refresh"). No disagreement: the whole draft is fixed (later passes skip the row).
    redraft     the next pass drafts only x_{f+1}..x_m (f = fixed positions): anchor x_f (a if f = 0) at
                n+k+1+f, context = true context + the refreshed states of positions n..n+k+f, Jacobi
                inputs x_{f+1}..x_{m-1}. The block stays fixed prefix + redrafted tail, m tokens.

Modes: "none" (Jacobi passes only), "refresh", "anchor" (the paper's method). Each token stays a
proposal the target verifies, so the output is lossless whatever a refresh decides.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

from ..models.draft_model import ContextKV, DraftModel
from ..protocol.kinds import Refinement
from .budget import StepCosts

__all__ = ["Refiner", "RowDrafter", "row_contexts"]


def row_contexts(model: DraftModel, base: ContextKV | None, n: int, states: torch.Tensor,
                 lengths: list[int]) -> list[ContextKV]:
    """Row b's draft context: the true context `base` + its first lengths[b] predicted states.

    states [B or 1, T, n_src*H]: predicted draft-model states of positions n..n+T-1 per row (one row:
    shared by all). Keeps the newest `context_window` positions; `last` = the projection of the newest."""
    proj = model.project_context(states)  # [B|1, T, H]
    g, t = proj.shape[:2]
    positions = torch.arange(n, n + t, device=model.device).expand(g, t)  # [B|1, T]
    keys, values = model.context_kv(proj, positions)  # per layer [B|1, T, kv, d]
    w = model.config.context_window
    out = []
    for b, length in enumerate(lengths):
        r = b if g > 1 else 0
        ks, vs, ps = [k[r, :length] for k in keys], [v[r, :length] for v in values], positions[r, :length]
        if base is not None and len(base):
            ks = [torch.cat([x, y])[-w:] for x, y in zip(base.keys, ks)]
            vs = [torch.cat([x, y])[-w:] for x, y in zip(base.values, vs)]
            ps = torch.cat([base.positions, ps])[-w:]
        out.append(ContextKV(ks, vs, ps, proj[r, length - 1]))  # draft() left-pads rows of unequal length
    return out


class RowDrafter(Protocol):
    """What refinement needs of a foresight drafter, bound to one request's true context (positions
    0..n-1; the block under verification starts at n)."""

    def refresh_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of tokens [rows, L] at positions n..n+L-1 (right-padded) -> the decoder's logits
        [rows, L, vocab] and the predicted draft-model states [rows, L, n_src*H]."""
        ...

    def draft_rows(self, states: torch.Tensor, lengths: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """One draft pass per row over inputs [rows, T] (anchor + Jacobi inputs), row b's context being the
        true context + states[b, :lengths[b]] (states [rows, T', n_src*H]) -> drafts [rows, T]."""
        ...


class Refiner:
    """Refines the B outcome drafts of one foresight round; `drafts`, `fixed` and the counts are per row."""

    def __init__(self, rows: RowDrafter, y0: int, block: list[int], outcomes: list[tuple[int, int]],
                 drafts: torch.Tensor, mode: Refinement, passes: int = 0, confidence: torch.Tensor | None = None):
        """drafts [B, m]: the rows' current drafts (after J0 and `passes` plain passes); rows: the drafter
        over the request's true context; confidence [B, m]: the draft model's top-1 probability of each
        draft (the verify-length controller's evidence), dropped for a row once refinement edits it."""
        self.rows, self.y0, self.block = rows, y0, list(block)
        self.outcomes, self.mode = list(outcomes), mode
        self.drafts = drafts.detach().to("cpu", torch.long).clone()  # [B, m] full-vocab ids
        b = self.drafts.shape[0]
        self.fixed = [0] * b  # leading draft positions fixed for the rest of the round (0..m)
        self.states: list[torch.Tensor | None] = [None] * b  # refreshed states [k+2+m, n_src*H]
        self.passes = [passes] * b  # Jacobi passes after J0 spent on the row
        self.refreshes = [0] * b
        rows = confidence.tolist() if confidence is not None else [None] * b
        self.confidence: list[list[float] | None] = rows

    @property
    def width(self) -> int:
        return self.drafts.shape[1]

    def open_rows(self) -> list[int]:
        """Rows with positions left to redraft."""
        return [b for b, f in enumerate(self.fixed) if f < self.width]

    def run(self, refreshes: int, costs: StepCosts | None = None, stop: Callable[[], bool] | None = None) -> None:
        """`refreshes` times: refresh the open rows, then one pass over those still open. The measured
        batch costs go into `costs`. `stop()` true before a refresh or a pass ends the refinement there: the
        drafts stay a valid block at every point (a refresh only fixes positions and writes guesses)."""
        if refreshes and self.mode == Refinement.NONE:
            raise ValueError("refinement 'none' runs no context refresh")
        stop = stop or (lambda: False)
        for _ in range(refreshes):
            rows = self.open_rows()
            if not rows or stop():
                break
            t0 = time.perf_counter()
            self.refresh(rows)
            t1 = time.perf_counter()
            tail = self.open_rows()
            if tail and stop():
                break
            if tail:
                self.redraft(tail)
            if costs is not None:
                costs.refreshes.observe(len(rows), t1 - t0)
                if tail:
                    costs.passes.observe(len(tail), time.perf_counter() - t1)

    @torch.inference_mode()
    def refresh(self, rows: list[int]) -> None:
        """Context refresh of `rows` and, per row, the replacement its mode makes."""
        m = self.width
        heads = [[self.y0, *self.block[:k], a] for k, a in (self.outcomes[b] for b in rows)]  # k+2 tokens
        tokens = torch.zeros(len(rows), max(map(len, heads)) + m, dtype=torch.long)  # [rows, L], right-padded
        for j, (b, head) in enumerate(zip(rows, heads)):
            tokens[j, :len(head)] = torch.tensor(head)
            tokens[j, len(head):len(head) + m] = self.drafts[b]
        logits, states = self.rows.refresh_rows(tokens)  # [rows, L, vocab], [rows, L, n_src*H]
        guesses = logits.argmax(-1).cpu()  # [rows, L]: position p guesses the token at p+1
        for j, (b, head) in enumerate(zip(rows, heads)):
            self.states[b] = states[j, :len(head) + m]
            self.refreshes[b] += 1
            self.confidence[b] = None  # the refined tokens are no longer the draft model's top-1
            self.replace(b, guesses[j, len(head) - 1:len(head) - 1 + m])

    def replace(self, b: int, guess: torch.Tensor) -> None:
        """Row b against the decoder's guesses [m] of x_1..x_m: fix the agreeing prefix and, in mode
        "anchor", write the guess at the first disagreement and fix it too."""
        f, x = self.fixed[b], self.drafts[b]
        wrong = (guess[f:] != x[f:]).nonzero()
        if not len(wrong):
            self.fixed[b] = self.width
            return
        i = f + int(wrong[0, 0])
        if self.mode == Refinement.ANCHOR:
            x[i] = guess[i]
            self.fixed[b] = i + 1
        else:
            self.fixed[b] = i

    @torch.inference_mode()
    def redraft(self, rows: list[int]) -> None:
        """One pass over each row's positions after its last fixed one (all rows refreshed before)."""
        fixed = [self.fixed[b] for b in rows]
        tails = [self.width - f for f in fixed]
        inputs = torch.zeros(len(rows), max(tails), dtype=torch.long)  # [rows, T]: anchor + inputs, right-padded
        for j, (b, f) in enumerate(zip(rows, fixed)):
            x = self.drafts[b]
            inputs[j, 0] = x[f - 1] if f else self.outcomes[b][1]
            inputs[j, 1:tails[j]] = x[f:self.width - 1]
        states = pad_sequence([self.states[b] for b in rows], batch_first=True)  # [rows, k_max+2+m, n_src*H]
        lengths = [self.outcomes[b][0] + 1 + f for b, f in zip(rows, fixed)]  # positions n..n+k+f
        out = self.rows.draft_rows(states, lengths, inputs).cpu()  # [rows, T]
        for j, (b, f) in enumerate(zip(rows, fixed)):
            self.drafts[b, f:] = out[j, :tails[j]]
            self.passes[b] += 1
