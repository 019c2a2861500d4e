"""Drafting with a trained JetSpec-style draft model (sync mode: J0 + J Jacobi passes after each outcome).

Per request it keeps the projected context keys/values, extended with each round's new target states
(the anchor of the previous round plus the accepted drafts), so a round costs only the new positions
plus one block pass per Jacobi iteration. `ForesightDrafter` drafts through one of these: its fallback
drafts and its pre-drafted rows share the request's context and noise generator kept here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, EngineConfig
from ..models.draft_model import ContextKV, DraftModel, SharedWeights, draw_noise, is_checkpoint
from ..protocol.messages import HiddenLayout
from ..models.compiled_draft import compiled_draft_for
from ..models.cpu_linear import use_cpu_linears
from ..models.loading import cache_root
from .proposer import Draft, DraftContext

STATE_KEY = "draft_model"  # the request's DraftModelState in DraftContext.states

DEFAULT_CHECKPOINT = "smollm2-135m-instruct"  # the embedded default target's drafter


def checkpoint_roots() -> list[Path]:
    """$FORESIGHT_CHECKPOINTS, else checkpoints/ at the repository root, else inside the package."""
    env = os.environ.get("FORESIGHT_CHECKPOINTS")
    if env:
        return [Path(env)]
    pkg = Path(__file__).resolve().parent.parent
    return [pkg.parent / "checkpoints", pkg / "checkpoints"]


def resolve_drafter_path(cfg: EngineConfig) -> Path | None:
    """The drafter checkpoint to load, or None for prompt lookup."""
    if cfg.drafter == "ngram":
        return None
    if cfg.drafter == "auto":
        if cfg.target is not None:
            return None  # shipped checkpoints belong to the embedded default target
        return next((r / DEFAULT_CHECKPOINT for r in checkpoint_roots() if is_checkpoint(r / DEFAULT_CHECKPOINT)), None)
    path = Path(cfg.drafter).expanduser()
    if not is_checkpoint(path):
        raise ConfigError(f"drafter: {path} is not a drafter checkpoint folder (config.json + model.safetensors)")
    return path


def load_drafter_target(cfg: EngineConfig):
    """The target model in the drafter's dtype, on the CPU: each part the drafter keeps (the draft model's copies of
    its embedding and LM head, the adapter's, the foresight decoder's top layers) goes to the drafter's device as it
    is built, so a target larger than the drafter's GPU never lands on it whole."""
    from ..models.loading import load_target, resolve_drafter_dtype, resolve_target

    dtype = resolve_drafter_dtype(cfg.drafter_dtype, cfg.dtype, cfg.drafter_device)
    return load_target(resolve_target(cfg.target), dtype, "cpu"), dtype


def served_draft_model(path: Path, target, dtype: torch.dtype, cfg: EngineConfig) -> DraftModel:
    """The draft model at `path` as the drafter worker serves it: on its device in `dtype`, its linears prepacked
    (`--cpu-linear`) and its block pass and context extension compiled (`--drafter-compile`) on a CPU."""
    model = DraftModel.load(path, SharedWeights.from_target(target), cfg.drafter_device, dtype)
    use_cpu_linears(model, cfg.cpu_linear, cfg.drafter_device, "draft model")
    compiled_draft_for(model, cfg.drafter_compile, cfg.drafter_device, cache_root() / "compiled", cfg.drafter_threads)
    return model


@dataclass(slots=True)
class DraftModelState:
    """One request's draft-model context."""

    ctx: ContextKV | None = None  # projected context K/V of positions 0..positions-1 (None: none yet)
    positions: int = 0  # context positions absorbed so far
    generator: torch.Generator = field(default_factory=torch.Generator)  # the request's draft noise
    # Committed target-state chunks [n, layout.width] taken from the context (`commit`), not absorbed yet
    pending: list[torch.Tensor] = field(default_factory=list)


class JetSpecProposer:
    name = "jetspec"
    supports_foresight = False  # foresight needs an adapter and decoder: ForesightDrafter

    def __init__(self, model: DraftModel, passes: int | None = None, layout: HiddenLayout | None = None):
        """`layout`: the target states the worker receives (None: the draft model's own sources)."""
        self.model = model
        sources = list(model.config.target_layers)  # the draft model's input: their states in this order
        self.layout = layout or HiddenLayout(tuple(sorted(set(sources))), model.config.target_hidden_size)
        # The draft model's columns of the states received; None: all of them, already in its order.
        self.columns = None if list(self.layout.layers) == sources else self.layout.columns(sources)
        self.passes = model.config.default_passes if passes is None else passes

    @classmethod
    def load(cls, path: str | Path, target, device: str = "cpu", dtype: torch.dtype = torch.float32,
             passes: int | None = None) -> "JetSpecProposer":
        """`target`: the target model (only its embedding and LM head are used)."""
        return cls(DraftModel.load(path, SharedWeights.from_target(target), device, dtype), passes)

    @classmethod
    def from_config(cls, path: Path, cfg: EngineConfig) -> "JetSpecProposer":
        target, dtype = load_drafter_target(cfg)
        return cls(served_draft_model(path, target, dtype, cfg), cfg.draft_passes)  # the target's layers are dropped

    def add_request(self, ctx: DraftContext) -> None:
        """The prompt's target states into the context K/V at once (`DrafterWorker.on_start`)."""
        self.absorb(ctx)

    def commit(self, ctx: DraftContext) -> None:
        """Take the round's committed states over; the draft model absorbs them when it next drafts (why not
        now: proposer.py)."""
        self.take(ctx)

    def state(self, ctx: DraftContext) -> DraftModelState:
        """The request's state, created on first use (its noise seeded by the request, independent of the
        target's draws)."""
        state = ctx.states.get(STATE_KEY)
        if state is None:
            state = ctx.states[STATE_KEY] = DraftModelState()
            state.generator.manual_seed(ctx.seed)
        return state

    def propose(self, ctx: DraftContext, max_drafts: int, passes: int | None = None) -> Draft:
        """J0 + `passes` Jacobi passes (None: the configured number) after the anchor."""
        return self.propose_batch([ctx], [max_drafts], passes)[0]

    def propose_batch(self, ctxs: list[DraftContext], max_drafts: list[int], passes: int | None = None) -> list[Draft]:
        """`propose` for several requests at once: one draft-model pass per Jacobi iteration for all of them.
        Rows are right-padded to the longest block; the block attends causally, so padding never changes a
        row's drafts, and each row draws its noise from its own generator as `propose` does."""
        drafts = [Draft()] * len(ctxs)
        rows = []  # (index, ctx, drafts wanted, state); none without target states (started without our layers)
        for i, (ctx, wanted) in enumerate(zip(ctxs, max_drafts)):
            if wanted > 0 and (state := self.absorb(ctx)).ctx is not None:
                rows.append((i, ctx, wanted, state))
        if not rows:
            return drafts
        width = max(wanted for _, _, wanted, _ in rows)
        noise = torch.zeros(len(rows), width - 1, dtype=torch.long)  # [B, width - 1]
        for r, (_, ctx, wanted, state) in enumerate(rows):
            noise[r, :wanted - 1] = draw_noise(ctx.tokens, wanted - 1, state.generator)
        anchors = torch.tensor([ctx.tokens[-1] for _, ctx, _, _ in rows])  # [B]
        ids, probs = self.model.draft_with_confidence([state.ctx for *_, state in rows], anchors, noise,
                                                      self.passes if passes is None else passes)
        for r, (i, _, wanted, _) in enumerate(rows):
            drafts[i] = Draft(ids[-1][r, :wanted].tolist(), probs[-1][r, :wanted].tolist())
        return drafts

    def take(self, ctx: DraftContext) -> DraftModelState:
        """The request's state, holding every committed target state not absorbed yet (`ctx.hidden`'s too)."""
        state = self.state(ctx)
        state.pending += ctx.take_hidden()
        return state

    def absorb(self, ctx: DraftContext) -> DraftModelState:
        """Take the committed target states not absorbed yet into the context K/V."""
        return self.absorb_new(ctx)[0]

    def absorb_new(self, ctx: DraftContext) -> tuple[DraftModelState, torch.Tensor | None]:
        """`absorb`, and the states [n, layout.width] it absorbed (None: none). If the draft model fails on
        them they stay pending, for the next try."""
        state = self.take(ctx)
        if not state.pending:
            return state, None
        states = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
        self.extend(ctx, states)
        state.pending.clear()  # absorbed into the context K/V: the raw states are no longer needed
        return state, states

    def extend(self, ctx: DraftContext, states: torch.Tensor | None) -> DraftModelState:
        """Extend the request's context K/V by `states` [n, layout.width]."""
        state = self.state(ctx)
        if states is not None:
            own = states if self.columns is None else states[:, self.columns]  # [n, n_src * H_t]
            with torch.inference_mode():
                state.ctx = self.model.extend_context(state.ctx, own, state.positions)
            state.positions += states.shape[0]
        return state
