"""The paper's outcome scorer (JetSpec++ 4.2, steps 1-2): the adapter predicts the target's states of the block
under verification, and the target's top layers (the decoder) run over that prediction to score its outcomes.

Per request the adapter's context and the decoder's K/V cache are built from the target's TRUE states of
committed positions, beside the draft model's context (the JetSpec proposer's). The target sends the states at
the sorted union of the indices the three read (`layout`); each takes its own `layout.columns`. On a hybrid
target the decoder's linear-attention layers (`layout.state_layers`) continue from the target's committed
recurrent/conv state, sent with each outcome (`LinearStates`, models/decoder.py).

    1. adapter   predicts the states of y0, d_1..d_gamma at positions n..n+gamma (its indices up to the
                 decoder's input; stages above it are dropped at construction)
    2. decoder   runs its top layers over the prediction at its input index -> p_hat rows, and the states it
                 passes through that the draft model also reads (indices above its input, the final-normed
                 index L). How deep it starts is `decoder_layers`: on a small target with a CPU-trained adapter
                 the top-15 decoder over the index-15 prediction scores outcomes far better than the top 3 over
                 the index-27 one (docs/journal/2026-11-29-first-measurements.md).
An outcome (k, a) then drafts over the true context + the PREDICTED states of positions n..n+k, anchor a at
n+k+1; refinement refreshes drafts by predicting their states again (`bound_rows`, refinement.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.decoder import ForesightDecoder
from ..models.draft_model import ContextKV, DraftModel
from ..protocol.messages import HiddenLayout
from .jetspec_proposer import DraftModelState
from .outcome_scorer import ForesightState, Prediction, block_rows, sorted_columns
from .outcomes import Outcome
from .proposer import DraftContext
from .refinement import row_contexts

# Positions per adapter-and-decoder pass of a catch-up: a message for another request waits at most one pass
# (fp32, 2-core development CPU, 15-layer decoder on one thread: ~75 ms for 32 positions).
CATCH_UP_ROWS = 32


def _take_rows(chunks: list[torch.Tensor], n: int) -> torch.Tensor:
    """The first `n` rows of the concatenated `chunks` [.., width], removed from them (the rest stays, one chunk)."""
    rows = torch.cat(chunks)
    chunks.clear()
    if rows.shape[0] > n:
        chunks.append(rows[n:])
    return rows[:n]


class AdapterDecoderScorer:
    """Scores outcomes with the adapter's prediction through the target's top layers: see the module."""

    refines = True
    greedy_first = True

    def __init__(self, model: DraftModel, adapter, decoder: ForesightDecoder):
        """`model`: the draft model the outcomes are drafted with (it reads some of the states the adapter
        predicts or the decoder passes through)."""
        if adapter is None or decoder is None:
            raise ValueError("foresight needs both an adapter and a decoder (DraftModelScorer: decoder depth 0)")
        self.adapter, self.decoder = adapter, decoder
        self.vocab_columns = sorted_columns(decoder.vocab_subset, decoder.vocab_size)
        n_target = decoder.config.num_hidden_layers
        hidden = decoder.config.hidden_size
        if model.config.target_hidden_size != hidden:
            raise ValueError(f"draft model reads target states of width {model.config.target_hidden_size}, "
                             f"the decoder's target has {hidden}")
        adapter_idx = [int(i) for i in adapter.target_indices]
        if adapter_idx != sorted(set(adapter_idx)):
            raise ValueError(f"adapter.target_indices must be ascending and distinct, got {adapter_idx}")
        if decoder.input_index in adapter_idx and adapter_idx[-1] > decoder.input_index:
            # A deeper decoder computes the upper states itself: the adapter's stages above its input idle.
            adapter_idx = [int(i) for i in adapter.truncate(decoder.input_index).target_indices]
        if decoder.input_index not in adapter_idx:
            raise ValueError(
                f"the decoder reads hidden_states index {decoder.input_index} (the target's top "
                f"{decoder.n_layers} layers) but the adapter predicts {adapter_idx}: the adapter must also "
                f"predict index {decoder.input_index}, or use a decoder of n_layers = {n_target} - "
                f"(one of the adapter's indices)")
        from_decoder = [i for i in model.config.target_layers if decoder.input_index < i <= n_target]
        missing = [i for i in model.config.target_layers if i not in adapter_idx and i not in from_decoder]
        if missing:
            raise ValueError(
                f"the draft model conditions on hidden_states indices {model.config.target_layers}; "
                f"{missing} are neither predicted by the adapter ({adapter_idx}) nor passed through by the "
                f"decoder (indices {decoder.input_index + 1}..{n_target}): the adapter must predict them")
        self.adapter_indices = adapter_idx
        # What the target sends: the union of what the three read; on a hybrid target also the committed state
        # of the decoder's linear-attention layers, from which they continue.
        self.layout = HiddenLayout(tuple(sorted({*model.config.target_layers, *adapter_idx, decoder.input_index})),
                                   hidden, tuple(decoder.linear_layers))
        self._adapter_cols = self.layout.columns(adapter_idx)
        self._decoder_cols = self.layout.columns([decoder.input_index])
        # Columns of the decoder's input in the adapter's prediction [.., n_adapter * H], laid out alike.
        self._pred_decoder_cols = HiddenLayout(tuple(adapter_idx), hidden).columns([decoder.input_index])
        # The decoder passes through the indices above its input (final-normed last): see predict_rows.
        self.decoder_keep = tuple(i for i in from_decoder if i != n_target)
        decoder_states = [*self.decoder_keep, n_target]
        self._draft_sources = [("adapter", adapter_idx.index(i)) if i in adapter_idx
                               else ("decoder", decoder_states.index(i)) for i in model.config.target_layers]
        self._hidden = hidden
        self.model = model

    @property
    def decoder_layers(self) -> int:
        return self.decoder.n_layers

    def new_state(self, model: DraftModelState) -> ForesightState:
        return ForesightState(model=model, adapter=self.adapter.new_context(), decoder=self.decoder.new_cache())

    def take_states(self, state: ForesightState, states: torch.Tensor | None, draft_only: bool) -> None:
        """Into the adapter's context now, unless `draft_only`; the decoder takes them in its next pass
        (`predict_blocks`, `_flush_decoder`). A pipelined miss drafts `draft_only` so the target does not wait
        for the adapter and decoder."""
        if states is not None:
            state.unscored.append(states)
        if not draft_only and state.unscored:
            states, start = torch.cat(state.unscored), state.scored
            with torch.inference_mode():
                state.adapter = self.adapter.extend_context(state.adapter, states[:, self._adapter_cols], start)
            state.decoder_new.append(states[:, self._decoder_cols])
            state.scored += states.shape[0]
            state.unscored.clear()

    def lags(self, ctx: DraftContext, state: ForesightState | None) -> bool:
        """Does the decoder lack more than one catch-up pass of the context (a new request's prompt)? A
        foresight job then catches up first, in passes a waiting message can stop; fewer positions it takes in
        the same decoder pass as the block."""
        return len(ctx.tokens) - 1 - (state.decoder.length if state is not None else 0) > CATCH_UP_ROWS

    @torch.inference_mode()
    def catch_up(self, state: ForesightState, stop: Callable[[], bool]) -> bool:
        """Take every committed state not absorbed yet into the adapter and the decoder now, CATCH_UP_ROWS
        positions a pass; `stop()` true between passes (a message waits) pauses it. True when done."""
        while state.unscored or state.decoder_new:
            if stop():
                return False
            if state.decoder_new:  # the older positions: already through the adapter
                new = _take_rows(state.decoder_new, CATCH_UP_ROWS)  # [n, H]
                done = not state.decoder_new and not state.unscored  # only then is the target's snapshot current
                self.decoder.extend_context(state.decoder, new, state.decoder.length,
                                            state.linear_states if done else None)
                continue
            states = _take_rows(state.unscored, CATCH_UP_ROWS)  # [n, layout.width]
            state.adapter = self.adapter.extend_context(state.adapter, states[:, self._adapter_cols], state.scored)
            state.decoder_new.append(states[:, self._decoder_cols])
            state.scored += states.shape[0]
        return True

    def _take_decoder_new(self, state: ForesightState) -> torch.Tensor | None:
        """The true states [m, H] at the decoder's input that its cache has not taken yet (cleared)."""
        new = torch.cat(state.decoder_new) if state.decoder_new else None
        state.decoder_new.clear()
        return new

    def _flush_decoder(self, state: ForesightState) -> None:
        new = self._take_decoder_new(state)
        if new is not None:
            self.decoder.extend_context(state.decoder, new, state.decoder.length, state.linear_states)

    @torch.inference_mode()
    def predict_blocks(self, states: list[ForesightState], ctxs: list[DraftContext],
                       blocks: list[list[int]]) -> list[Prediction]:
        """Steps 1-2 for several requests' blocks [y0, d_1..d_gamma] in one adapter pass and one decoder pass
        (each decoder cache takes its request's new context states in that pass) -> per request the tensors
        of `ForesightDrafter.predict`, [gamma_g+1, ...] each."""
        ns = [len(ctx.tokens) - 1 for ctx in ctxs]
        for state, n in zip(states, ns):
            if state.scored != n:
                raise ValueError(f"foresight needs the true states of positions 0..{n - 1}, have {state.scored}")
        tokens, lengths = block_rows(ctxs, blocks)
        pred, logits, dec_states = self._predict(states, ns, tokens, [self._take_decoder_new(s) for s in states])
        return [(pred[g, :n], logits[g, :n], dec_states[g, :n]) for g, n in enumerate(lengths)]

    @torch.inference_mode()
    def predict_rows(self, state: ForesightState, n: int, tokens: torch.Tensor,
                     decoder_new: torch.Tensor | None = None):
        """Rows of tokens [R, L] at positions n..n+L-1 over one request's true context (causal: right-padding
        is harmless) -> adapter prediction [R, L, n_adapter*H], decoder logits [R, L, vocab] (float32) and the
        decoder's states the draft model reads [R, L, n_dec*H] (indices above the decoder's input, then the
        final-normed state). `decoder_new` [m, H] (one row only): the decoder's new context states, taken
        into its cache in the same pass."""
        rows = tokens.shape[0]
        return self._predict([state] * rows, [n] * rows, tokens, [decoder_new] + [None] * (rows - 1))

    @torch.inference_mode()
    def _predict(self, states: list[ForesightState], ns: list[int], tokens: torch.Tensor,
                 news: list[torch.Tensor | None]):
        """Row g of tokens [G, L] at positions ns[g].. over states[g]'s true context (rows may share one) ->
        the tensors of `predict_rows`, [G, L, ...]. news[g] [m, H]: the decoder's new context states its
        row takes in the same pass (None: pending ones are taken first, on their own). If the pass fails,
        each request keeps the new states its cache did not take."""
        for state, new in zip(states, news):
            if new is None:
                self._flush_decoder(state)
        try:
            actxs = [state.adapter for state in states]
            if hasattr(self.adapter, "predict_many"):
                pred = self.adapter.predict_many(actxs, tokens.long(), ns)  # [G, L, n_adapter * H]
            elif all(s is states[0] for s in states):  # an adapter without it (the tests' oracle): one request
                pred = self.adapter.predict(actxs[0], tokens.long(), ns[0])
            else:  # or one call per request
                pred = torch.cat([self.adapter.predict(a, tokens[g:g + 1].long(), n)
                                  for g, (a, n) in enumerate(zip(actxs, ns))])
            logits, dec_states = self.decoder.logits_and_hidden_many(
                [state.decoder for state in states], pred[..., self._pred_decoder_cols], ns, keep=self.decoder_keep,
                context_states=news, linear_states=[state.linear_states for state in states])
        except BaseException:
            for state, new, n in zip(states, news, ns):
                if new is not None and state.decoder.length < n:  # not taken: the next pass takes it
                    state.decoder_new.insert(0, new)
            raise
        return pred, logits, dec_states

    def draft_states(self, pred: torch.Tensor, dec_states: torch.Tensor) -> torch.Tensor:
        """The predicted states in the draft model's source order: [(R,) L, n_src * H] from the adapter's
        [(R,) L, n_adapter * H] and the decoder's [(R,) L, n_dec * H] (`predict_rows`)."""
        h = self._hidden
        parts = [(pred if src == "adapter" else dec_states)[..., j * h:(j + 1) * h].float()
                 for src, j in self._draft_sources]
        return torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def draft_outcomes(self, state: ForesightState, n: int, states: torch.Tensor, outcomes: list[tuple[int, int]],
                       noise: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4: one batch, row b continues outcome (k_b, a_b).

        states [gamma+1, n_src*H]: predicted draft-model states of positions n..n+gamma; noise [B, m-1].
        Row b's context is the true context + states[:k_b+1] (the newest `context_window` positions),
        its anchor a_b at position n+k_b+1. Returns the last pass's drafts [B, m] and the draft model's
        top-1 probability of each [B, m]."""
        contexts = row_contexts(self.model, state.draft, n, states[None], [k + 1 for k, _ in outcomes])
        anchors = torch.tensor([a for _, a in outcomes], dtype=torch.long)
        ids, probs = self.model.draft_with_confidence(contexts, anchors, noise, passes)
        return ids[-1], probs[-1]

    def outcome_rows(self, ctx: DraftContext, state: ForesightState, states: torch.Tensor, block: list[int],
                     outcomes: list[Outcome]) -> tuple[list[ContextKV], list[list[int]]]:
        """Step 4's rows: per outcome (k, a) its draft context, the true context + the predicted states
        states [gamma+1, n_src*H] of positions n..n+k (n = the anchor's), and its block's fixed inputs, the
        anchor a alone."""
        n = len(ctx.tokens) - 1
        contexts = row_contexts(self.model, state.draft, n, states[None], [o.k + 1 for o in outcomes])
        return contexts, [[o.a] for o in outcomes]

    def bound_rows(self, state: ForesightState, n: int) -> "_BoundRows":
        """The scorer over the request's true context of n positions, as `Refiner` drafts with it."""
        return _BoundRows(self, state, n)


@dataclass(frozen=True, slots=True)
class _BoundRows:
    """The scorer over one request's true context at position n: what `Refiner` drafts with."""

    scorer: AdapterDecoderScorer
    state: ForesightState
    n: int

    def refresh_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred, logits, dec_states = self.scorer.predict_rows(self.state, self.n, tokens)  # [rows, L, ...]
        return logits, self.scorer.draft_states(pred, dec_states)

    def draft_rows(self, states: torch.Tensor, lengths: list[int], inputs: torch.Tensor) -> torch.Tensor:
        model = self.scorer.model
        return model.draft_pass(row_contexts(model, self.state.draft, self.n, states, lengths), inputs)
