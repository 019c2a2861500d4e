"""Foresight drafting (JetSpec++ section 4.2): while the target verifies a block, pre-draft the blocks of the
outcomes it expects, several requests in one batch.

`ForesightDrafter` composes a JetSpec proposer (the draft model, which keeps each request's context) and an
outcome scorer (outcome_scorer.py: the adapter and the target's top layers, or at decoder depth 0 the draft
model itself). While the target verifies block [y0, d_1..d_gamma] (anchor y0 at position n = len(tokens)-1):

    1-2. scores    the scorer's p_hat rows for the block (`OutcomeScorer.predict_blocks`)
    3.   outcomes  Eq. 6 scores, the B best (Eq. 7); B, J and R from the round's plan (`budget.py`, Eq. 3):
                   what fits the verify time by the measured costs, within the caps
    4.   drafting  per outcome (k, a) the scorer's rows (`outcome_rows`), J0 noise from tokens + d_1..d_k + a
                   (the request's own generator), then J-R Jacobi passes; all B rows in one batch
    5.   refining  R times: a context refresh of each row's draft, anchor replacement, one more pass over the
                   positions after the fixed ones (`refinement.py`, section 4.3), where the scorer refines.
                   The mode ("none", "refresh", "anchor") is the request's (`DraftContext.refinement`, from
                   StartDraft) or the engine's.

Temperature: p_hat is the scorer's softmax at temperature 1 (appendix B.1), or at the request's sampling
temperature (`DraftContext.temperature`, sent in StartDraft; a `temperature` given at construction overrides
it). At temperature 0 the outcome law is a point mass on the scorer's greedy path, so that outcome is cached first
(where the scorer's `greedy_first`) and the rest of the cache follows the temperature-1 scores.

Several requests' rounds run as one batch (`foresee_batch`, foresight_batch.py; `foresee` is its one-request
case): steps 1-2 and 4 take one pass for all of them.

Scores follow the request's verification (StartDraft's sampling): top-k and top-p truncate p_hat as they
truncate the target's distribution, and under nucleus verification drafts inside p_hat's nucleus count as surely
accepted (`outcomes.py`). With a calibration fit on held-out rounds (appendix B.1, `calibration.py`; shipped as
`<adapter>/calibration.json`), calibrated scores rank the outcomes instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import ConfigError, EngineConfig
from ..protocol.kinds import Refinement
from ..protocol.messages import SamplingParams
from ..models.compiled_adapter import compiled_adapter_for
from ..models.compiled_decoder import compiled_decoder_for
from ..models.cpu_linear import use_cpu_linears
from ..models.loading import cache_root
from .budget import Plan, StepCosts, plan_round
from .calibration import FILE_NAME as CALIBRATION_FILE, Calibration
from .decoder_scorer import AdapterDecoderScorer
from .draft_model_scorer import DraftModelScorer
from .foresight_batch import BatchedForesight, ForesightStats
from ..models.decoder import ForesightDecoder, keep_decoder_parts
from ..models.draft_model import DraftModel
from .jetspec_proposer import JetSpecProposer, load_drafter_target, served_draft_model
from .outcome_scorer import ForesightState, OutcomeScorer, Prediction
from .outcome_selection import select_for_request
from .outcomes import Outcome
from .proposer import Draft, DraftContext

STATE_KEY = "foresight"  # the request's ForesightState in DraftContext.states

__all__ = ["ForesightDrafter"]


class ForesightDrafter(BatchedForesight):
    """A JetSpec draft model with foresight: supports pipelined mode. Its rounds, for one request or several
    in one batch, are `BatchedForesight`'s (foresight_batch.py); its scores the `scorer`'s."""

    name = "jetspec++"
    supports_foresight = True

    def __init__(self, model: DraftModel, scorer: OutcomeScorer, passes: int | None = None, cache_size: int = 4,
                 foresight_passes: int | None = None, temperature: float | None = None,
                 refreshes: int | None = None, refinement: Refinement = Refinement.ANCHOR, use_budget: bool = True,
                 calibration: Calibration | None = None):
        """`scorer`: what scores outcomes and gives their draft rows (`AdapterDecoderScorer`, `DraftModelScorer`);
        `passes`: Jacobi passes after J0 in sync mode (pipelined misses draft J0 only);
        `foresight_passes`: J at most for pre-drafted blocks (default `passes`); `cache_size`: B at most;
        `refreshes`: R at most (None: up to J); `refinement`: the default mode (none | refresh | anchor; none
        where the scorer cannot refine); `use_budget`: False plans the caps whatever the verify time (tests,
        fixed-J/R ablations); `temperature`: the sampling temperature to score outcomes at (None: temperature 1,
        the paper's); `calibration`: calibrated outcome scores (appendix B.1, `calibration.py`; None: Eq. 6)."""
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        if refreshes is not None and refreshes < 0:
            raise ValueError("refreshes must be >= 0")
        self.model, self.scorer = model, scorer
        self.cache_size = cache_size
        self.passes = model.config.default_passes if passes is None else passes
        self.foresight_passes = self.passes if foresight_passes is None else foresight_passes
        self.refines = scorer.refines
        self.refreshes = refreshes if self.refines else 0
        self.use_budget = use_budget
        self.refinement = Refinement.parse(refinement, "refinement") if self.refines else Refinement.NONE
        self.temperature = temperature
        self.calibration = calibration
        self.costs = StepCosts()  # measured costs of the prediction and of batched passes and refreshes
        self.stats = ForesightStats()
        self.jetspec = JetSpecProposer(model, self.passes, layout=scorer.layout)  # takes its columns itself
        self.layout = self.jetspec.layout  # what the target sends: everything the draft model and scorer read

    @property
    def decoder_layers(self) -> int:
        """The target layers that score the outcomes (0: the draft model scores them itself)."""
        return self.scorer.decoder_layers

    # ------------------------------------------------------------------ contexts

    def add_request(self, ctx: DraftContext) -> None:
        """A new request's prompt into the draft model only (`DrafterWorker.on_start`): what every strategy
        needs; the scorer takes the states when foresight first runs."""
        self.absorb(ctx, draft_only=True)

    def commit(self, ctx: DraftContext) -> None:
        """Take the round's committed states over (the JetSpec proposer keeps them for the draft model, which
        hands them on to the scorer); the models absorb them when they next run (why not now: proposer.py)."""
        self.jetspec.commit(ctx)

    def state(self, ctx: DraftContext) -> ForesightState:
        state = ctx.states.get(STATE_KEY)
        if state is None:
            state = ctx.states[STATE_KEY] = self.scorer.new_state(self.jetspec.state(ctx))
        return state

    def absorb(self, ctx: DraftContext, draft_only: bool = False) -> ForesightState:
        """Feed the committed target states not yet absorbed (`commit`'s, and ctx.hidden's) into the draft
        model's context and, unless `draft_only`, the scorer's (a pipelined miss drafts `draft_only`, so the
        target does not wait for the scorer)."""
        state = self.state(ctx)
        state.linear_states = ctx.linear_states
        _, states = self.jetspec.absorb_new(ctx)  # [n, layout.width] or None
        self.scorer.take_states(state, states, draft_only)
        return state

    def lags(self, ctx: DraftContext) -> bool:
        """Does the scorer lack more than one catch-up pass of the context (a new request's prompt)? A foresight
        job then catches up first, in passes a waiting message can stop."""
        return self.scorer.lags(ctx, ctx.states.get(STATE_KEY))

    @torch.inference_mode()
    def catch_up(self, ctx: DraftContext, stop: Callable[[], bool]) -> bool:
        """Take every committed state not absorbed yet into the draft model and the scorer now; `stop()` true
        between passes (a message waits) pauses it. True when done. (Mode auto switching to pipelined: no
        pipelined round then waits for the catch-up.)"""
        return self.scorer.catch_up(self.absorb(ctx, draft_only=True), stop)

    # ------------------------------------------------------------------ fallback

    def propose(self, ctx: DraftContext, max_drafts: int) -> Draft:
        """Sync mode: J0 + `passes` (the JetSpec proposer's). Pipelined miss: the fallback, J0 only."""
        return self.propose_batch([ctx], [max_drafts])[0]

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int]) -> list[Draft]:
        """`propose` for several requests in one draft-model pass per iteration (sync rounds and pipelined
        misses take different numbers of passes: one batch each)."""
        for ctx, wanted in zip(ctxs, max_drafts):
            if wanted > 0:
                self.absorb(ctx, draft_only=True)
        drafts = [Draft()] * len(ctxs)
        for pipelined in (False, True):
            rows = [i for i, ctx in enumerate(ctxs) if ctx.pipelined == pipelined]
            if rows:
                got = self.jetspec.propose_batch([ctxs[i] for i in rows], [max_drafts[i] for i in rows],
                                                 passes=0 if pipelined else self.passes)
                for i, draft in zip(rows, got):
                    drafts[i] = draft
        return drafts

    # ------------------------------------------------------------------ foresight: scores (steps 1-2)

    def predict(self, ctx: DraftContext, block: list[int]) -> Prediction:
        """Steps 1-2 for the block under verification: the adapter's prediction [gamma+1, n_adapter*H] (None at
        depth 0), the scores' logits [gamma+1, vocab] (float32) and the decoder's states [gamma+1, n_dec*H]."""
        return self.predict_blocks([self.absorb(ctx)], [ctx], [block])[0]

    def predict_blocks(self, states: list[ForesightState], ctxs: list[DraftContext],
                       blocks: list[list[int]]) -> list[Prediction]:
        """`predict` for several requests that have absorbed their contexts, in one pass."""
        return self.scorer.predict_blocks(states, ctxs, blocks)

    # ------------------------------------------------------------------ foresight: selection, drafting (steps 3-5)

    def select(self, logits: torch.Tensor, block: list[int], B: int, temperature: float | None,
               sampling: SamplingParams | None = None, confidence: Sequence[float] = (),
               calibrated: bool = True) -> list[Outcome]:
        """Step 3: the B outcomes to pre-draft, best first (outcome_selection.py), under the request's own
        verification (`sampling`); with a calibration (and `calibrated`), its scores rank them; `confidence`
        [gamma]: the draft model's probability of each draft, one of their features."""
        return select_for_request(logits, block, B, temperature, sampling,
                                  self.calibration if calibrated else None, confidence, self.scorer.greedy_first,
                                  self.scorer.vocab_columns)

    def plan(self, budget_s: float, mode: Refinement) -> Plan:
        """This round's B, J, R (Eq. 3, `budget.plan_round`): caps `cache_size`, `foresight_passes` and
        `refreshes` (None: J; mode "none": 0); the caps alone without a budget or with use_budget off."""
        j = self.foresight_passes
        r = 0 if mode == Refinement.NONE else j if self.refreshes is None else self.refreshes
        return plan_round(self.costs, budget_s if self.use_budget else 0.0, self.cache_size, j, r)


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
    keep_decoder_parts(target, n_layers, cfg.drafter_device)  # the rest of the target is not the drafter's
    decoder = ForesightDecoder(target, n_layers=n_layers, vocab_subset=subset)
    decoder_layers = torch.nn.ModuleList(decoder.layers)  # the target layers it runs (shared)
    for part, name in ((adapter, "adapter"), (decoder_layers, "foresight decoder")):
        use_cpu_linears(part, cfg.cpu_linear, cfg.drafter_device, name)
    scorer = AdapterDecoderScorer(model, adapter, decoder)
    drafter = ForesightDrafter(model, scorer, passes=cfg.draft_passes, cache_size=cfg.cache_size,
                               foresight_passes=cfg.foresight_passes, refreshes=cfg.draft_refreshes,
                               refinement=cfg.refinement, use_budget=cfg.foresight_budget,
                               calibration=load_calibration(cfg, adapter_path))
    compiled_decoder_for(decoder, scorer.decoder_keep, cfg.drafter_compile, cfg.drafter_device,
                         cache_root() / "compiled", cfg.drafter_threads)
    compiled_adapter_for(scorer.adapter, cfg.drafter_compile, cfg.drafter_device, cache_root() / "compiled",
                         cfg.drafter_threads)
    return drafter


def draft_only_from_config(drafter_path: Path, cfg: EngineConfig) -> ForesightDrafter:
    """The draft model from its checkpoint, with foresight at decoder depth 0. A calibration only from a
    PATH: the one shipped beside the adapter (`auto`) was fit on the decoder's scores."""
    model = JetSpecProposer.from_config(drafter_path, cfg).model
    calibration = None if cfg.calibration in ("auto", "none") else load_calibration(cfg, drafter_path)
    return ForesightDrafter(model, DraftModelScorer(model), passes=cfg.draft_passes, cache_size=cfg.cache_size,
                            foresight_passes=cfg.foresight_passes, use_budget=cfg.foresight_budget,
                            calibration=calibration)


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
