"""Foresight drafting (JetSpec++ section 4.2) with batched drafting of the selected outcomes.

`ForesightDrafter` composes the draft model, the adapter and the decoder. Per request it keeps three
contexts built from the target's TRUE states of committed positions: the draft model's projected
context K/V, the adapter's context and the decoder's K/V cache. The target sends the states at
`hidden_layers`, the sorted union of the indices the three read, concatenated in that order; each
consumer gets its own columns.

While the target verifies block [y0, d_1..d_gamma] (anchor y0 at position n = len(tokens)-1):

    1. adapter   predicts the states of y0, d_1..d_gamma at positions n..n+gamma (all its indices)
    2. decoder   runs its top layers over the prediction at its input index -> p_hat rows, and the
                 final-normed states (index L) the draft model also reads
    3. outcomes  Eq. 6 scores, the B best (Eq. 7); B = `cache_size`, fewer when the measured cost of
                 one batched draft says they do not fit the verify time (Eq. 3)
    4. drafting  outcome (k, a): context = true context + the PREDICTED states of rows 0..k
                 (positions n..n+k), anchor a at n+k+1, J0 noise from tokens + d_1..d_k + a (the
                 request's own generator), then J Jacobi passes; all B rows in one batch

Temperature: p_hat is the decoder's softmax at temperature 1 (appendix B.1), or at the request's
sampling temperature (`DraftContext.temperature`, sent in StartDraft; a `temperature` given at
construction overrides it). At temperature 0 the outcome law is a point mass on the decoder's greedy path, so that
outcome is cached first and the rest of the cache follows the temperature-1 scores.

Not here yet: context refresh and anchor replacement (section 4.3), calibrated scores (appendix B.1).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, EngineConfig
from .decoder import DecoderCache, ForesightDecoder
from .draft_model import ContextKV, DraftModel, SharedWeights, draw_noise
from .jetspec_proposer import JetSpecProposer, load_drafter_target
from .outcomes import Outcome, outcome_scores, select_outcomes
from .proposer import DraftContext
from .speculation_cache import CacheEntry

__all__ = ["ForesightDrafter"]

COST_EMA = 0.3  # weight of the newest measurement of the per-outcome drafting cost


@dataclass(slots=True)
class _RequestState:
    draft: ContextKV | None = None  # the draft model's projected context K/V
    adapter: object = None  # the adapter's context
    decoder: DecoderCache | None = None
    positions: int = 0  # context positions absorbed so far (0..positions-1)
    chunks: int = 0  # DraftContext.hidden chunks absorbed so far
    generator: torch.Generator = field(default_factory=torch.Generator)


@dataclass(slots=True)
class ForesightStats:
    """The last foresight call, for benchmarks and tests."""

    outcomes: int = 0  # B drafted
    predict_s: float = 0.0  # adapter + decoder + scoring
    draft_s: float = 0.0  # the batched draft (J0 + J passes)
    total_s: float = 0.0


class ForesightDrafter(JetSpecProposer):
    """A JetSpec draft model with foresight (adapter + decoder): supports pipelined mode."""

    name = "jetspec++"
    supports_foresight = True

    def __init__(self, model: DraftModel, adapter, decoder: ForesightDecoder, passes: int | None = None,
                 cache_size: int = 4, foresight_passes: int | None = None, temperature: float | None = None):
        """`passes`: Jacobi passes after J0 in sync mode (pipelined misses draft J0 only);
        `foresight_passes`: passes for pre-drafted blocks (default `passes`); `cache_size`: B at most;
        `temperature`: the sampling temperature to score outcomes at (None: temperature 1, the paper's)."""
        super().__init__(model, passes)
        if adapter is None or decoder is None:
            raise ValueError("foresight needs both an adapter and a decoder (use JetSpecProposer without them)")
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.adapter, self.decoder = adapter, decoder
        self.cache_size = cache_size
        self.foresight_passes = self.passes if foresight_passes is None else foresight_passes
        self.temperature = temperature
        n_target = decoder.config.num_hidden_layers
        hidden = decoder.config.hidden_size
        if model.config.target_hidden_size != hidden:
            raise ValueError(f"draft model reads target states of width {model.config.target_hidden_size}, "
                             f"the decoder's target has {hidden}")
        adapter_idx = [int(i) for i in adapter.target_indices]
        if adapter_idx != sorted(set(adapter_idx)):
            raise ValueError(f"adapter.target_indices must be ascending and distinct, got {adapter_idx}")
        if decoder.input_index not in adapter_idx:
            raise ValueError(
                f"the decoder reads hidden_states index {decoder.input_index} (the target's top "
                f"{decoder.n_layers} layers) but the adapter predicts {adapter_idx}: the adapter must also "
                f"predict index {decoder.input_index}, or use a decoder of n_layers = {n_target} - "
                f"(one of the adapter's indices)")
        missing = [i for i in model.config.target_layers if i not in adapter_idx and i != n_target]
        if missing:
            raise ValueError(
                f"the draft model conditions on hidden_states indices {model.config.target_layers}; "
                f"{missing} are neither predicted by the adapter ({adapter_idx}) nor the decoder's "
                f"final-normed output (index {n_target}): the adapter must predict them")
        self.adapter_indices = adapter_idx
        self.hidden_layers = sorted({*model.config.target_layers, *adapter_idx, decoder.input_index})

        def cols(indices: list[int]) -> torch.Tensor:
            return torch.cat([torch.arange(hidden) + self.hidden_layers.index(i) * hidden for i in indices])

        # Columns of each consumer in the target's message (hidden_layers order).
        self._draft_cols = cols(list(model.config.target_layers))
        self._adapter_cols = cols(adapter_idx)
        self._decoder_cols = cols([decoder.input_index])
        # Columns of the decoder's input, and of the draft model's sources, in the adapter's prediction.
        self._pred_decoder_cols = torch.arange(hidden) + adapter_idx.index(decoder.input_index) * hidden
        self._draft_sources = [("adapter", adapter_idx.index(i)) if i in adapter_idx else ("decoder", 0)
                               for i in model.config.target_layers]
        self._hidden = hidden
        self.outcome_cost_s = 0.0  # measured seconds per drafted outcome (EMA); 0 = not measured yet
        self.stats = ForesightStats()

    # ------------------------------------------------------------------ contexts

    def _absorb(self, ctx: DraftContext) -> _RequestState:
        """Feed the new true target states (ctx.hidden chunks) into all three contexts."""
        state = ctx.drafter_state
        if state is None:
            state = ctx.drafter_state = _RequestState(adapter=self.adapter.new_context(),
                                                      decoder=self.decoder.new_cache())
            state.generator.manual_seed(ctx.seed)  # independent of the target's draws
        new = ctx.hidden[state.chunks:]
        if new:
            states = torch.cat(new) if len(new) > 1 else new[0]  # [n, len(hidden_layers) * H]
            start = state.positions
            with torch.inference_mode():
                state.draft = self.model.extend_context(state.draft, states[:, self._draft_cols], start)
                state.adapter = self.adapter.extend_context(state.adapter, states[:, self._adapter_cols], start)
                self.decoder.extend_context(state.decoder, states[:, self._decoder_cols], start)
            state.positions += states.shape[0]
            state.chunks = len(ctx.hidden)
        return state

    absorb = _absorb

    # ------------------------------------------------------------------ fallback

    def propose(self, ctx: DraftContext, max_drafts: int) -> list[int]:
        """Sync mode: J0 + `passes` (as JetSpecProposer). Pipelined miss: the fallback, J0 only."""
        if max_drafts <= 0:
            return []
        state = self._absorb(ctx)
        if state.draft is None:
            return []
        noise = draw_noise(ctx.tokens, max_drafts - 1, state.generator)
        passes = 0 if ctx.pipelined else self.passes
        outs = self.model.draft([state.draft], torch.tensor([ctx.tokens[-1]]), noise[None], passes)
        return outs[-1][0].tolist()

    # ------------------------------------------------------------------ foresight

    @torch.inference_mode()
    def predict(self, ctx: DraftContext, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2 for the block under verification: adapter prediction [gamma+1, n_adapter*H],
        decoder logits [gamma+1, vocab] (float32) and final-normed states [gamma+1, H]."""
        state = self._absorb(ctx)
        n = len(ctx.tokens) - 1
        if state.positions != n:
            raise ValueError(f"foresight needs the true states of positions 0..{n - 1}, have {state.positions}")
        tokens = torch.tensor([[ctx.tokens[-1], *block]], dtype=torch.long)
        pred = self.adapter.predict(state.adapter, tokens, n)[0]  # [gamma+1, n_adapter * H]
        logits, normed = self.decoder.logits_and_hidden(state.decoder, pred[:, self._pred_decoder_cols], n)
        return pred, logits, normed

    def select(self, logits: torch.Tensor, block: list[int], B: int, temperature: float | None) -> list[Outcome]:
        """Step 3: the B outcomes to pre-draft, best first (Eq. 6-7; greedy path first at temperature 0)."""
        t = 1.0 if not temperature else temperature
        scores = outcome_scores(torch.softmax(logits / t, dim=-1), block)
        picked = select_outcomes(scores, B)
        if temperature is None or temperature > 0:
            return picked
        top = logits.argmax(-1).tolist()  # the decoder's greedy path: accept while d_i is row i-1's argmax
        k = next((i for i, d in enumerate(block) if top[i] != d), len(block))
        greedy = Outcome(k, top[k], float(scores.prefix[k] * scores.anchor[k, top[k]]))
        return [greedy] + [o for o in picked if (o.k, o.a) != (greedy.k, greedy.a)][: B - 1]

    def draft_states(self, pred: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The predicted states in the draft model's source order: [gamma+1, n_src * H]."""
        h = self._hidden
        parts = [pred[:, j * h:(j + 1) * h].float() if src == "adapter" else normed.float()
                 for src, j in self._draft_sources]
        return torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def draft_outcomes(self, state: _RequestState, n: int, states: torch.Tensor, outcomes: list[tuple[int, int]],
                       noise: torch.Tensor, passes: int) -> torch.Tensor:
        """Step 4: one batch, row b continues outcome (k_b, a_b).

        states [gamma+1, n_src*H]: predicted draft-model states of positions n..n+gamma; noise [B, m-1].
        Row b's context is the true context + states[:k_b+1] (the newest `context_window` positions),
        its anchor a_b at position n+k_b+1. Returns the last pass's drafts [B, m]."""
        model = self.model
        proj = model.project_context(states[None])  # [1, gamma+1, H]
        positions = torch.arange(n, n + states.shape[0], device=model.device)
        keys, values = model.context_kv(proj, positions[None])
        keys, values = [k[0] for k in keys], [v[0] for v in values]
        base = state.draft
        w = model.config.context_window
        contexts = []
        for k, _ in outcomes:
            ks, vs, ps = [kk[:k + 1] for kk in keys], [vv[:k + 1] for vv in values], positions[:k + 1]
            if base is not None and len(base):
                ks = [torch.cat([a, b])[-w:] for a, b in zip(base.keys, ks)]
                vs = [torch.cat([a, b])[-w:] for a, b in zip(base.values, vs)]
                ps = torch.cat([base.positions, ps])[-w:]
            contexts.append(ContextKV(ks, vs, ps, proj[0, k]))  # draft() left-pads rows of unequal length
        anchors = torch.tensor([a for _, a in outcomes], dtype=torch.long)
        return model.draft(contexts, anchors, noise, passes)[-1]

    def outcome_budget(self, budget_s: float, spent_s: float) -> int:
        """Eq. 3 with a per-outcome cost: B = (verify time - prediction time) / (one outcome's J0 + J passes),
        between 1 and `cache_size`. No budget or no measurement yet: `cache_size`."""
        if budget_s <= 0 or self.outcome_cost_s <= 0:
            return self.cache_size
        fit = math.floor((budget_s - spent_s) / self.outcome_cost_s)
        return max(1, min(self.cache_size, fit))

    def foresee(self, ctx: DraftContext, block: list[int], max_drafts: int, budget_s: float) -> list[CacheEntry]:
        if max_drafts <= 0:
            return []
        t0 = time.perf_counter()
        state = self._absorb(ctx)
        if state.draft is None:
            return []
        n = len(ctx.tokens) - 1
        pred, logits, normed = self.predict(ctx, block)
        # A fixed temperature given at construction wins; else the request's own (from StartDraft).
        temperature = self.temperature if self.temperature is not None else ctx.temperature
        t1 = time.perf_counter()
        B = self.outcome_budget(budget_s, t1 - t0)
        picked = self.select(logits, block, B, temperature)
        if not picked:
            return []
        noise = torch.stack([draw_noise(ctx.tokens + block[:o.k] + [o.a], max_drafts - 1, state.generator)
                             for o in picked])  # [B, max_drafts-1]
        t2 = time.perf_counter()
        drafts = self.draft_outcomes(state, n, self.draft_states(pred, normed), [(o.k, o.a) for o in picked],
                                     noise, self.foresight_passes).tolist()
        t3 = time.perf_counter()
        cost = (t3 - t2) / len(picked)
        self.outcome_cost_s = cost if not self.outcome_cost_s else \
            self.outcome_cost_s + COST_EMA * (cost - self.outcome_cost_s)
        self.stats = ForesightStats(len(picked), t1 - t0, t3 - t2, t3 - t0)
        return [CacheEntry(accepted=o.k, bonus=o.a, tokens=tuple(d), score=o.score, passes=self.foresight_passes)
                for o, d in zip(picked, drafts)]


def resolve_adapter_path(cfg: EngineConfig, drafter_path: Path) -> Path | None:
    """`auto`: the adapter shipped beside the drafter (`<drafter>/adapter`), if any; `none`: no foresight."""
    from .adapter import is_adapter_checkpoint

    if cfg.adapter == "none":
        return None
    if cfg.adapter == "auto":
        path = drafter_path / "adapter"
        return path if is_adapter_checkpoint(path) else None
    path = Path(cfg.adapter).expanduser()
    if not is_adapter_checkpoint(path):
        raise ConfigError(f"adapter: {path} is not an adapter checkpoint folder (config.json + model.safetensors)")
    return path


def foresight_from_config(drafter_path: Path, adapter_path: Path, cfg: EngineConfig) -> ForesightDrafter:
    """Draft model + adapter from their checkpoints, decoder = the target's layers above the adapter's top index."""
    from .adapter import Adapter

    target, dtype = load_drafter_target(cfg)
    model = DraftModel.load(drafter_path, SharedWeights.from_target(target), cfg.drafter_device, dtype)
    adapter = Adapter.load(adapter_path, target, cfg.drafter_device, dtype)
    decoder = ForesightDecoder(target, n_layers=target.config.num_hidden_layers - max(adapter.target_indices))
    return ForesightDrafter(model, adapter, decoder, passes=cfg.draft_passes, cache_size=cfg.cache_size)
