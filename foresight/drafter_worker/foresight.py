"""Foresight drafting (JetSpec++ section 4.2) with batched drafting of the selected outcomes.

`ForesightDrafter` composes a JetSpec proposer (the draft model), the adapter and the decoder. Per request
three contexts are built from the target's TRUE states of committed positions: the draft model's projected
context K/V (kept by the JetSpec proposer), the adapter's context and the decoder's K/V cache (kept here). The
target sends the states at the sorted union of the indices the three read (`layout`, a `HiddenLayout`); each
consumer takes its own `layout.columns`.
On a hybrid target the decoder's linear-attention layers (`layout.state_layers`) also continue from the
target's committed recurrent/conv state, sent with each outcome (`LinearStates`, models/decoder.py).

While the target verifies block [y0, d_1..d_gamma] (anchor y0 at position n = len(tokens)-1):

    1. adapter   predicts the states of y0, d_1..d_gamma at positions n..n+gamma (its indices up to
                 the decoder's input; stages above it are dropped at construction)
    2. decoder   runs its top layers over the prediction at its input index -> p_hat rows, and the
                 states it passes through that the draft model also reads (indices above its input,
                 the final-normed index L). How deep it starts is `decoder_layers`: on a small target
                 with a CPU-trained adapter the top-15 decoder over the index-15 prediction scores
                 outcomes far better than the top 3 over the index-27 one (docs/journal/2026-11-29-first-measurements.md). At
                 depth 0 the draft model scores the outcomes itself (draft_foresight.py).
    3. outcomes  Eq. 6 scores, the B best (Eq. 7); B, J and R from the round's plan (`budget.py`, Eq. 3):
                 what fits the verify time by the measured costs, within the caps
    4. drafting  outcome (k, a): context = true context + the PREDICTED states of rows 0..k
                 (positions n..n+k), anchor a at n+k+1, J0 noise from tokens + d_1..d_k + a (the
                 request's own generator), then J-R Jacobi passes; all B rows in one batch
    5. refining  R times: a context refresh of each row's draft, anchor replacement, one more pass over
                 the positions after the fixed ones (`refinement.py`, section 4.3). The mode ("none",
                 "refresh", "anchor") is the request's (`DraftContext.refinement`, from StartDraft) or
                 the engine's.

Temperature: p_hat is the decoder's softmax at temperature 1 (appendix B.1), or at the request's
sampling temperature (`DraftContext.temperature`, sent in StartDraft; a `temperature` given at
construction overrides it). At temperature 0 the outcome law is a point mass on the decoder's greedy path, so that
outcome is cached first and the rest of the cache follows the temperature-1 scores.

Several requests' rounds run as one batch (`foresee_batch`, foresight_batch.py; `foresee` is its one-
request case): steps 1-2 and 4 take one pass for all of them, with the stages defined here.

Scores follow the request's verification (StartDraft's sampling): top-k and top-p truncate p_hat as
they truncate the target's distribution, and under nucleus verification drafts inside p_hat's nucleus
count as surely accepted (`outcomes.py`). With a calibration fit on held-out rounds (appendix B.1,
`calibration.py`; shipped as `<adapter>/calibration.json`), calibrated scores rank the outcomes instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import ConfigError, EngineConfig
from ..protocol.kinds import Refinement
from ..protocol.messages import HiddenLayout, LinearStates, SamplingParams
from ..models.compiled_adapter import compiled_adapter_for
from ..models.compiled_decoder import compiled_decoder_for
from ..models.cpu_linear import use_cpu_linears
from ..models.loading import cache_root
from ..spec.sampling import target_probs
from ..spec.verification import in_nucleus
from .budget import Plan, StepCosts, plan_round
from .calibration import FILE_NAME as CALIBRATION_FILE, Calibration, calibrated_scores
from .foresight_batch import BatchedForesight, ForesightStats
from ..models.decoder import DecoderCache, ForesightDecoder
from ..models.draft_model import ContextKV, DraftModel
from .jetspec_proposer import DraftModelState, JetSpecProposer, load_drafter_target, served_draft_model
from .outcomes import Outcome, outcome_scores, select_outcomes
from .proposer import Draft, DraftContext
from .refinement import row_contexts

STATE_KEY = "foresight"  # the request's _RequestState in DraftContext.states

__all__ = ["ForesightDrafter"]

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


@dataclass(slots=True)
class _RequestState:
    model: DraftModelState  # the draft model's context and the request's noise generator (the JetSpec proposer's)
    adapter: object = None  # the adapter's context
    decoder: DecoderCache | None = None
    scored: int = 0  # context positions the adapter and decoder have absorbed
    unscored: list = field(default_factory=list)  # [n, ...] target states the draft model took, the adapter not yet
    decoder_new: list = field(default_factory=list)  # [n, H] states at the decoder's input its cache lacks
    linear_states: LinearStates | None = None  # hybrid targets: the newest committed state of the decoder's layers

    @property
    def draft(self) -> ContextKV | None:
        return self.model.ctx


class ForesightDrafter(BatchedForesight):
    """A JetSpec draft model with foresight (adapter + decoder): supports pipelined mode. Its rounds,
    for one request or several in one batch, are `BatchedForesight`'s (foresight_batch.py)."""

    name = "jetspec++"
    supports_foresight = True
    greedy_first = True  # at temperature 0 the scorer's greedy path is cached first (`select`)

    def __init__(self, model: DraftModel, adapter, decoder: ForesightDecoder, passes: int | None = None,
                 cache_size: int = 4, foresight_passes: int | None = None, temperature: float | None = None,
                 refreshes: int | None = None, refinement: Refinement = Refinement.ANCHOR, use_budget: bool = True,
                 calibration: Calibration | None = None):
        """`passes`: Jacobi passes after J0 in sync mode (pipelined misses draft J0 only);
        `foresight_passes`: J at most for pre-drafted blocks (default `passes`); `cache_size`: B at most;
        `refreshes`: R at most (None: up to J); `refinement`: the default mode (none | refresh | anchor);
        `use_budget`: False plans the caps whatever the verify time (tests, fixed-J/R ablations);
        `temperature`: the sampling temperature to score outcomes at (None: temperature 1, the paper's);
        `calibration`: calibrated outcome scores (appendix B.1, `calibration.py`; None: Eq. 6 as it is)."""
        if adapter is None or decoder is None:
            raise ValueError("foresight needs both an adapter and a decoder (DraftOnlyForesight: decoder depth 0)")
        self._init_round(model, passes, cache_size, foresight_passes, temperature, refreshes, refinement,
                         use_budget, calibration)
        self.adapter, self.decoder = adapter, decoder
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
        self.jetspec = JetSpecProposer(model, self.passes, layout=self.layout)  # takes its columns itself
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

    def _init_round(self, model: DraftModel, passes: int | None, cache_size: int, foresight_passes: int | None,
                    temperature: float | None, refreshes: int | None, refinement: Refinement, use_budget: bool,
                    calibration: Calibration | None) -> None:
        """What every foresight round reads, whatever scores its outcomes (see `__init__`)."""
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        if refreshes is not None and refreshes < 0:
            raise ValueError("refreshes must be >= 0")
        self.model = model
        self.cache_size = cache_size
        self.passes = model.config.default_passes if passes is None else passes
        self.foresight_passes = self.passes if foresight_passes is None else foresight_passes
        self.refreshes, self.use_budget = refreshes, use_budget
        self.refinement = Refinement.parse(refinement, "refinement")
        self.temperature = temperature
        self.calibration = calibration
        self.costs = StepCosts()  # measured costs of the prediction and of batched passes and refreshes
        self.stats = ForesightStats()

    @property
    def decoder_layers(self) -> int:
        """The target layers that score the outcomes (0: the draft model scores them itself)."""
        return self.decoder.n_layers

    # ------------------------------------------------------------------ contexts

    def add_request(self, ctx: DraftContext) -> None:
        """A new request's prompt into the draft model only (`DrafterWorker.on_start`): what every strategy
        needs; the adapter and decoder take the states when foresight first runs."""
        self._absorb(ctx, draft_only=True)

    def commit(self, ctx: DraftContext) -> None:
        """Take the round's committed states over (the JetSpec proposer keeps them for the draft model, which
        hands them on to the adapter and decoder); the models absorb them when they next run (why not now:
        proposer.py)."""
        self.jetspec.commit(ctx)

    def state(self, ctx: DraftContext) -> _RequestState:
        state = ctx.states.get(STATE_KEY)
        if state is None:
            state = ctx.states[STATE_KEY] = _RequestState(
                model=self.jetspec.state(ctx), adapter=self.adapter.new_context(), decoder=self.decoder.new_cache())
        return state

    def _absorb(self, ctx: DraftContext, draft_only: bool = False) -> _RequestState:
        """Feed the committed target states not yet absorbed (`commit`'s, and ctx.hidden's) into the draft
        model's context and, unless `draft_only`, the adapter's; the decoder takes them in its next pass
        (`predict`, `_flush_decoder`). A pipelined miss drafts with `draft_only` so the target does not wait
        for the adapter and decoder."""
        state = self.state(ctx)
        state.linear_states = ctx.linear_states
        _, states = self.jetspec.absorb_new(ctx)  # [n, layout.width] or None
        if states is not None:
            state.unscored.append(states)
        if not draft_only and state.unscored:
            states, start = torch.cat(state.unscored), state.scored
            with torch.inference_mode():
                state.adapter = self.adapter.extend_context(state.adapter, states[:, self._adapter_cols], start)
            state.decoder_new.append(states[:, self._decoder_cols])
            state.scored += states.shape[0]
            state.unscored.clear()
        return state

    absorb = _absorb

    def lags(self, ctx: DraftContext) -> bool:
        """Does the decoder lack more than one catch-up pass of the context (a new request's prompt)? A
        foresight job then catches up first, in passes a waiting message can stop; fewer positions it takes in
        the same decoder pass as the block."""
        state = ctx.states.get(STATE_KEY)
        return len(ctx.tokens) - 1 - (state.decoder.length if state is not None else 0) > CATCH_UP_ROWS

    @torch.inference_mode()
    def catch_up(self, ctx: DraftContext, stop: Callable[[], bool]) -> bool:
        """Take every committed state not absorbed yet into the draft model, the adapter and the decoder now,
        CATCH_UP_ROWS positions a pass; `stop()` true between passes (a message waits) pauses it. True when
        done. (Mode auto switching to pipelined: no pipelined round then waits for the catch-up.)"""
        state = self._absorb(ctx, draft_only=True)
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

    def _take_decoder_new(self, state: _RequestState) -> torch.Tensor | None:
        """The true states [m, H] at the decoder's input that its cache has not taken yet (cleared)."""
        new = torch.cat(state.decoder_new) if state.decoder_new else None
        state.decoder_new.clear()
        return new

    def _flush_decoder(self, state: _RequestState) -> None:
        new = self._take_decoder_new(state)
        if new is not None:
            self.decoder.extend_context(state.decoder, new, state.decoder.length, state.linear_states)

    # ------------------------------------------------------------------ fallback

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        """Sync mode: J0 + `passes` (the JetSpec proposer's). Pipelined miss: the fallback, J0 only."""
        return self.propose_batch([ctx], [max_drafts])[0]

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
        """`propose` for several requests in one draft-model pass per iteration (sync rounds and pipelined
        misses take different numbers of passes: one batch each)."""
        for ctx, wanted in zip(ctxs, max_drafts):
            if wanted > 0:
                self._absorb(ctx, draft_only=True)
        drafts = [Draft()] * len(ctxs)
        for pipelined in (False, True):
            rows = [i for i, ctx in enumerate(ctxs) if ctx.pipelined == pipelined]
            if rows:
                got = self.jetspec.propose_batch([ctxs[i] for i in rows], [max_drafts[i] for i in rows],
                                                 passes=0 if pipelined else self.passes)
                for i, draft in zip(rows, got):
                    drafts[i] = draft
        return drafts

    # ------------------------------------------------------------------ foresight: prediction (steps 1-2)

    @torch.inference_mode()
    def predict(self, ctx: DraftContext, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2 for the block under verification: adapter prediction [gamma+1, n_adapter*H],
        decoder logits [gamma+1, vocab] (float32) and the decoder's states [gamma+1, n_dec*H]."""
        return self._predict_block(self._absorb(ctx), ctx, block)

    def _predict_block(self, state: _RequestState, ctx: DraftContext, block: list[int]):
        """`predict` on a state that has absorbed ctx already (`_predict_blocks` of one request)."""
        return self._predict_blocks([state], [ctx], [block])[0]

    def _predict_blocks(self, states: list[_RequestState], ctxs: list[DraftContext], blocks: list[list[int]]):
        """Steps 1-2 for several requests' blocks [y0, d_1..d_gamma] in one adapter pass and one decoder pass
        (each decoder cache takes its request's new context states in that pass) -> per request the tensors
        of `predict`, [gamma_g+1, ...] each."""
        ns = [len(ctx.tokens) - 1 for ctx in ctxs]
        for state, n in zip(states, ns):
            if state.scored != n:
                raise ValueError(f"foresight needs the true states of positions 0..{n - 1}, have {state.scored}")
        tokens, lengths = block_rows(ctxs, blocks)
        pred, logits, dec_states = self._predict(states, ns, tokens, [self._take_decoder_new(s) for s in states])
        return [(pred[g, :n], logits[g, :n], dec_states[g, :n]) for g, n in enumerate(lengths)]

    @torch.inference_mode()
    def predict_rows(self, state: _RequestState, n: int, tokens: torch.Tensor,
                     decoder_new: torch.Tensor | None = None):
        """Rows of tokens [R, L] at positions n..n+L-1 over one request's true context (causal: right-padding
        is harmless) -> adapter prediction [R, L, n_adapter*H], decoder logits [R, L, vocab] (float32) and the
        decoder's states the draft model reads [R, L, n_dec*H] (indices above the decoder's input, then the
        final-normed state). `decoder_new` [m, H] (one row only): the decoder's new context states, taken
        into its cache in the same pass."""
        rows = tokens.shape[0]
        return self._predict([state] * rows, [n] * rows, tokens, [decoder_new] + [None] * (rows - 1))

    @torch.inference_mode()
    def _predict(self, states: list[_RequestState], ns: list[int], tokens: torch.Tensor,
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

    # ------------------------------------------------------------------ foresight: selection, drafting (steps 3-5)

    def select(self, logits: torch.Tensor, block: list[int], B: int, temperature: float | None,
               sampling: SamplingParams | None = None, confidence: Sequence[float] = (),
               calibrated: bool = True) -> list[Outcome]:
        """Step 3: the B outcomes to pre-draft, best first (Eq. 6-7; greedy path first at temperature 0).

        Scored under the request's own verification (`sampling`: top-k, top-p, exact or nucleus), so that
        with a perfect decoder the scores are the outcome law (Proposition 1). At temperature 0 the rest of
        the cache is ranked at temperature 1, where the nucleus gate of greedy verification is built too.
        With a calibration (and `calibrated`), the calibrated scores of appendix B.1 rank the outcomes;
        `confidence` [gamma]: the draft model's probability of each draft, one of their features."""
        t = 1.0 if not temperature else temperature
        top_k, top_p = (sampling.top_k, sampling.top_p) if sampling is not None else (0, 1.0)
        probs = target_probs(logits, t, top_k, top_p)  # [gamma+1, vocab]  p_hat as the target processes p
        sure = None
        if sampling is not None and sampling.verification == "nucleus" and block:
            sure = in_nucleus(probs[: len(block)], torch.tensor(block), sampling.nucleus_threshold)  # [gamma]
        if calibrated and self.calibration is not None:
            scores = calibrated_scores(probs, block, self.calibration, confidence, sure)
        else:
            scores = outcome_scores(probs, block, sure)
        picked = select_outcomes(scores, B)
        if temperature is None or temperature > 0 or not self.greedy_first:
            return picked
        top = logits.argmax(-1).tolist()  # the decoder's greedy path: accept while d_i is row i-1's argmax
        passed = [d == top[i] or (sure is not None and bool(sure[i])) for i, d in enumerate(block)]
        k = next((i for i, ok in enumerate(passed) if not ok), len(block))
        greedy = Outcome(k, top[k], float(scores.prefix[k] * scores.anchor[k, top[k]]))
        return [greedy] + [o for o in picked if (o.k, o.a) != (greedy.k, greedy.a)][: B - 1]

    def draft_states(self, pred: torch.Tensor, dec_states: torch.Tensor) -> torch.Tensor:
        """The predicted states in the draft model's source order: [(R,) L, n_src * H] from the adapter's
        [(R,) L, n_adapter * H] and the decoder's [(R,) L, n_dec * H] (`predict_rows`)."""
        h = self._hidden
        parts = [(pred if src == "adapter" else dec_states)[..., j * h:(j + 1) * h].float()
                 for src, j in self._draft_sources]
        return torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def draft_outcomes(self, state: _RequestState, n: int, states: torch.Tensor, outcomes: list[tuple[int, int]],
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

    def outcome_rows(self, ctx: DraftContext, state: _RequestState, states: torch.Tensor, block: list[int],
                     outcomes: list[Outcome]) -> tuple[list[ContextKV], list[list[int]]]:
        """Step 4's rows: per outcome (k, a) its draft context, the true context + the predicted states
        states [gamma+1, n_src*H] of positions n..n+k (n = the anchor's), and its block's fixed inputs, the
        anchor a alone."""
        n = len(ctx.tokens) - 1
        contexts = row_contexts(self.model, state.draft, n, states[None], [o.k + 1 for o in outcomes])
        return contexts, [[o.a] for o in outcomes]

    def bound_rows(self, state: _RequestState, n: int) -> "_BoundRows":
        """This drafter over the request's true context of n positions, as `Refiner` drafts with it."""
        return _BoundRows(self, state, n)

    def plan(self, budget_s: float, mode: Refinement) -> Plan:
        """This round's B, J, R (Eq. 3, `budget.plan_round`): caps `cache_size`, `foresight_passes` and
        `refreshes` (None: J; mode "none": 0); the caps alone without a budget or with use_budget off."""
        j = self.foresight_passes
        r = 0 if mode == Refinement.NONE else j if self.refreshes is None else self.refreshes
        return plan_round(self.costs, budget_s if self.use_budget else 0.0, self.cache_size, j, r)


@dataclass(frozen=True, slots=True)
class _BoundRows:
    """The drafter over one request's true context at position n: what `Refiner` drafts with."""

    drafter: ForesightDrafter
    state: _RequestState
    n: int

    def refresh_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred, logits, dec_states = self.drafter.predict_rows(self.state, self.n, tokens)  # [rows, L, ...]
        return logits, self.drafter.draft_states(pred, dec_states)

    def draft_rows(self, states: torch.Tensor, lengths: list[int], inputs: torch.Tensor) -> torch.Tensor:
        model = self.drafter.model
        return model.draft_pass(row_contexts(model, self.state.draft, self.n, states, lengths), inputs)


def block_rows(ctxs: list[DraftContext], blocks: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Each request's [anchor, d_1..d_gamma] as rows [G, L], a shorter block right-padded with its anchor (the
    rows are causal: padding changes no real position), and each row's real length."""
    lengths = [len(block) + 1 for block in blocks]
    width = max(lengths)
    tokens = torch.tensor([[ctx.tokens[-1], *block] + ctx.tokens[-1:] * (width - length)
                           for ctx, block, length in zip(ctxs, blocks, lengths)])
    return tokens, lengths


def resolve_adapter_path(cfg: EngineConfig, drafter_path: Path) -> Path | None:
    """`auto`: the adapter shipped beside the drafter (`<drafter>/adapter`), if any; `none`: no foresight."""
    from ..models.adapter import is_adapter_checkpoint

    if cfg.adapter == "none":
        return None
    if cfg.adapter == "auto":
        path = drafter_path / "adapter"
        return path if is_adapter_checkpoint(path) else None
    path = Path(cfg.adapter).expanduser()
    if not is_adapter_checkpoint(path):
        raise ConfigError(f"adapter: {path} is not an adapter checkpoint folder (config.json + model.safetensors)")
    return path


def adapter_depth(adapter_path: Path | None) -> int | None:
    """The decoder depth an adapter checkpoint recommends (`foresight eval-foresight`'s choice, recorded at
    training; 0: the draft model's own scores), read without loading it; None: none recorded."""
    from ..models.adapter import AdapterConfig

    if adapter_path is None:
        return None
    return AdapterConfig.read(adapter_path).decoder_layers


def foresight_from_config(drafter_path: Path, adapter_path: Path, cfg: EngineConfig) -> ForesightDrafter:
    """Draft model + adapter from their checkpoints, decoder = the target's layers above the adapter's top index."""
    from ..models.adapter import Adapter

    target, dtype = load_drafter_target(cfg)
    model = served_draft_model(drafter_path, target, dtype, cfg)
    adapter = Adapter.load(adapter_path, target, cfg.drafter_device, dtype)
    n_target = target.config.num_hidden_layers
    n_layers = cfg.decoder_layers or adapter.config.decoder_layers or n_target - max(adapter.target_indices)
    if n_layers > n_target or n_target - n_layers not in adapter.target_indices:
        raise ConfigError(f"decoder_layers: the decoder's input (index {n_target} - {n_layers}) must be an index the "
                          f"adapter predicts ({adapter.target_indices}): choose one of "
                          f"{[n_target - i for i in adapter.target_indices]}")
    subset = model.vocab_subset if model.config.vocab_subset_size else None  # the draft model's vocabulary
    decoder = ForesightDecoder(target, n_layers=n_layers, vocab_subset=subset)
    decoder_layers = torch.nn.ModuleList(decoder.layers)  # the target layers it runs (shared)
    for part, name in ((adapter, "adapter"), (decoder_layers, "foresight decoder")):
        use_cpu_linears(part, cfg.cpu_linear, cfg.drafter_device, name)
    drafter = ForesightDrafter(model, adapter, decoder, passes=cfg.draft_passes, cache_size=cfg.cache_size,
                               refreshes=cfg.draft_refreshes, refinement=cfg.refinement,
                               use_budget=cfg.foresight_budget, calibration=load_calibration(cfg, adapter_path))
    compiled_decoder_for(decoder, drafter.decoder_keep, cfg.drafter_compile, cfg.drafter_device,
                         cache_root() / "compiled", cfg.drafter_threads)
    compiled_adapter_for(drafter.adapter, cfg.drafter_compile, cfg.drafter_device, cache_root() / "compiled",
                         cfg.drafter_threads)
    return drafter


def load_calibration(cfg: EngineConfig, adapter_path: Path) -> Calibration | None:
    """`auto`: the calibration fit for the shipped adapter (`<adapter>/calibration.json`), if any; `none`: the
    uncalibrated Eq. 6 scores; else the file given."""
    if cfg.calibration == "none":
        return None
    if cfg.calibration == "auto":
        path = adapter_path / CALIBRATION_FILE
        return Calibration.load(path) if path.is_file() else None
    path = Path(cfg.calibration).expanduser()
    if not path.is_file():
        raise ConfigError(f"calibration: {path} does not exist (auto | none | PATH to a calibration.json)")
    return Calibration.load(path)
