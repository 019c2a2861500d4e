"""The drafter worker process: keeps each request's draft context and answers outcomes with blocks.

Sync mode: each `Outcome` is absorbed into the request's context, committed to the proposer (`commit`: it
takes the round's target states) and answered with a fresh block.
Pipelined mode: right after sending a block the drafter queues foresight for it; whenever no message
is waiting it runs the queued jobs, pre-drafting blocks for the outcomes it expects into the
speculation cache: every live job in one batch when the proposer can (`foresee_batch`: one adapter,
decoder and draft-model pass for all of them), else the oldest. The next `Outcome` is answered from the
cache on a hit, else by a fallback draft.
Messages always go first: foresight never delays an answer the target is waiting for.
Either way the block sent is the prefix the verify-length controller expects to commit the most tokens
per second (`verify_length.py`; `--verify-length max` sends every draft).

Each `Outcome` names the strategy of the round it asks for (`strategies.py`): which proposer drafts,
whether foresight follows. Rounds the target runs alone ("ar", "ngram") it reports in the next Outcome that
wants a block (`Outcome.drafts`: tokens this drafter never drafted); the draft model absorbs their states
when it next drafts, in one pass over all of them. An Outcome with `catch_up` (mode auto about to switch to
"pipelined") has the foresight proposer run its adapter and decoder over them too, now: in passes of a few
dozen positions whenever no message and no foresight job waits, answered with DrafterIdle when done.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.kinds import Strategy
from ..protocol.messages import DraftBlock, DrafterIdle, Outcome, ReleaseDraft, Shutdown, StartDraft, WorkerReady
from ..protocol.liveness import Heartbeats, prepare_worker_process, worker_lifetime
from ..placement import pin_worker
from ..protocol.sockets import MessageSocket
from ..spec.sampling import banned_tokens, drafts_before_banned
from .ngram import NgramProposer
from .proposer import Draft, DraftContext, Proposer
from .round_log import RoundLog
from .strategies import auto_strategies, offered_strategies
from ..control.costs import CostBySize, RunningCost
from ..control.verify_length import VerifyLengthController
from ..models.compiled_adapter import compiled_adapter_info
from ..models.compiled_decoder import compiled_decoder_info
from ..models.compiled_draft import compiled_draft_info

log = logging.getLogger("foresight.drafter")

IDLE_POLL_MS = 100


@dataclass(slots=True, frozen=True)
class ForesightJob:
    req_id: str
    round: int  # the round whose block the target is verifying now
    max_drafts: int


@dataclass(slots=True, frozen=True)
class CatchUp:
    """An `Outcome.catch_up` the foresight proposer has not finished; answered with DrafterIdle when done."""

    req_id: str
    round: int


@dataclass(slots=True)
class BlockAsk:
    """An outcome that wants a freshly drafted block (no speculation-cache hit)."""

    ctx: DraftContext
    proposer: Proposer
    max_drafts: int
    started: float  # when its outcome was taken in: the block's drafting time counts from here


class StopWatch:
    """Foresight's `stop` callback that remembers whether it ever said stop (the job was cut)."""

    def __init__(self, waiting):
        self.waiting, self.stopped = waiting, False

    def __call__(self) -> bool:
        self.stopped = self.stopped or bool(self.waiting())
        return self.stopped


def why_no_foresight(cfg: EngineConfig) -> str | None:
    """Why `make_proposer(cfg)` would build no foresight drafter (None: it would), decided from the
    checkpoint folders alone: no model is loaded."""
    from .foresight import resolve_adapter_path
    from .jetspec_proposer import resolve_drafter_path

    path = resolve_drafter_path(cfg)
    if path is None:
        return f"--drafter {cfg.drafter} means prompt lookup here (no trained drafter found), which has no foresight"
    if cfg.decoder_layers != 0 and resolve_adapter_path(cfg, path) is None:
        return f"the drafter {path} comes without an adapter (--adapter {cfg.adapter}; --decoder-layers 0 needs none)"
    return None


def make_proposer(cfg: EngineConfig) -> Proposer:
    """ngram; or a draft-model checkpoint (`auto`: the shipped one of the embedded default) -> JetSpec,
    with foresight (pipelined mode) when an adapter checkpoint comes with it, or at decoder depth 0 (the
    draft model's own scores) without one."""
    from .foresight import adapter_depth, draft_only_from_config, foresight_from_config, resolve_adapter_path
    from .jetspec_proposer import JetSpecProposer, resolve_drafter_path

    path = resolve_drafter_path(cfg)
    if path is None:
        return NgramProposer(cfg.ngram_max, cfg.ngram_min)
    adapter = resolve_adapter_path(cfg, path)
    if cfg.decoder_layers == 0 or (cfg.decoder_layers is None and adapter_depth(adapter) == 0):
        return draft_only_from_config(path, cfg)
    if adapter is None:
        return JetSpecProposer.from_config(path, cfg)
    return foresight_from_config(path, adapter, cfg)


class DrafterWorker:
    def __init__(self, cfg: EngineConfig, addrs: WorkerAddresses, proposer: Proposer, ctx: zmq.Context):
        self.cfg = cfg
        self.proposer = proposer
        self.strategies = offered_strategies(proposer, cfg)  # strategy -> its proposer
        # Bound here: a drafter restarted beside a running target takes over the same address.
        self.recv_from_target = MessageSocket(ctx, zmq.PULL, addrs.target_to_drafter, bind=True)
        self.send_to_target = MessageSocket(ctx, zmq.PUSH, addrs.drafter_to_target, bind=False)
        self.send_to_api = MessageSocket(ctx, zmq.PUSH, addrs.workers_to_api, bind=False)
        self.contexts: dict[str, DraftContext] = {}  # every request's one object (its state, its foreseen blocks)
        self.jobs: deque[ForesightJob] = deque()
        self.catch_ups: deque[CatchUp] = deque()  # run when no message and no foresight job waits
        self.verify = RunningCost()  # the target's verify time of our blocks: the foresight budget
        # One verify-length controller per proposer (acceptance is the proposer's), sharing the target's
        # measured verify cost by block length.
        cost = CostBySize()
        self.lengths = None if cfg.verify_length == "max" else {
            p.name: VerifyLengthController(allow_skip=cfg.verify_length == "auto", cost=cost)
            for p in self.strategies.values()}
        self.stopping = False
        self.round_log = RoundLog(cfg.round_log) if cfg.round_log else None  # --round-log (round_log.py)
        self.heartbeats = Heartbeats(ctx, addrs.workers_to_api, "drafter")
        self.handlers = {
            StartDraft: self.on_start,
            Outcome: self.on_outcome,
            ReleaseDraft: self.on_release,
            Shutdown: self.on_shutdown,
        }

    def run(self) -> None:
        scorer = getattr(self.proposer, "scorer", None)  # foresight's (decoder_scorer.py: adapter and decoder)
        self.send_to_api.send(WorkerReady(worker="drafter", pid=os.getpid(), layout=self.proposer.layout, info={
            "proposer": self.proposer.name, "supports_foresight": self.proposer.supports_foresight,
            "strategies": [Strategy.AR, Strategy.NGRAM] + sorted(self.strategies),
            "auto_strategies": auto_strategies(self.strategies),
            "decoder_layers": getattr(self.proposer, "decoder_layers", None),
            "calibration": calibration_source(self.proposer),
            "compiled": compiled_draft_info(getattr(self.proposer, "model", None))
            | compiled_decoder_info(getattr(scorer, "decoder", None))
            | compiled_adapter_info(getattr(scorer, "adapter", None))}))
        with self.heartbeats:
            try:
                self.loop()
            finally:
                if self.round_log is not None:
                    self.round_log.close()

    def loop(self) -> None:
        while not self.stopping:
            self.heartbeats.turn()
            msg = self.recv_from_target.recv(timeout_ms=0 if self.jobs or self.catch_ups else IDLE_POLL_MS)
            if msg is not None:
                self.handle([msg, *self.waiting_messages()])
            elif self.jobs:
                self.run_jobs()
            elif self.catch_ups:
                self.run_catch_up()

    def waiting_messages(self) -> list:
        msgs = []
        while (msg := self.recv_from_target.recv_nowait()) is not None:
            msgs.append(msg)
        return msgs

    def handle(self, msgs: list) -> None:
        """Messages in arrival order. The fresh blocks their outcomes ask for are drafted after all of them,
        together: a batched target step reports its requests' outcomes at once, and one draft-model pass
        drafts for all of them (`propose_batch`) for little more than one request costs."""
        asks = []
        for msg in msgs:
            if isinstance(msg, Outcome):
                asks.append(self.take_outcome(msg))
            else:
                self.handlers[type(msg)](msg)
        asks = [a for a in asks if a is not None and self.contexts.get(a.ctx.req_id) is a.ctx]  # not released
        for proposer in {a.proposer for a in asks}:
            self.answer([a for a in asks if a.proposer is proposer])

    def on_start(self, msg: StartDraft) -> None:
        hidden = [msg.hidden] if msg.hidden is not None else []
        ctx = self.contexts[msg.req_id] = DraftContext(
            req_id=msg.req_id, tokens=list(msg.prompt_ids), seed=msg.seed, hidden=hidden,
            temperature=msg.temperature, refinement=msg.refinement, proposer=self.proposer.name,
            sampling=msg.sampling, linear_states=msg.linear_states,
            banned=banned_tokens(msg.sampling.logit_bias) if msg.sampling is not None else frozenset())
        self.add_request(ctx)

    def add_request(self, ctx: DraftContext) -> None:
        """The primary proposer (every strategy drafts through it) sets up the request now and takes the
        prompt's target states into its context, not in the first round that asks for a block: in mode auto
        that round may come late, and the prompt's cost is not a round's (it would make the strategy that
        pays it look slow)."""
        try:
            self.proposer.add_request(ctx)
        except Exception:  # the first drafting round absorbs them instead (and reports a failure there)
            log.exception("request %s: absorbing the prompt's target states failed", ctx.req_id)

    def commit(self, ctx: DraftContext) -> None:
        """The outcome's tokens and states are committed in `ctx`: the primary proposer (which keeps every
        strategy's state) takes the states over. It runs no model there (proposer.py), so answering the
        outcome does not wait."""
        try:
            self.proposer.commit(ctx)
        except Exception:  # the states stay in the context; the next draft takes them (and reports a failure)
            log.exception("request %s: committing the round's target states failed", ctx.req_id)

    def on_outcome(self, msg: Outcome) -> None:
        self.handle([msg])

    def take_outcome(self, msg: Outcome) -> BlockAsk | None:
        """Verification of the last block ended at (k, a): take it in, and answer with the next block at once
        from the speculation cache; a block to draft afresh is returned (`answer` drafts it)."""
        ctx = self.contexts.get(msg.req_id)
        if ctx is None:
            return None  # released meanwhile
        logged = self.round_log is not None and ctx.pipelined and msg.drafts is None  # a pipelined block of ours
        verified, predicted = len(ctx.last_block), ctx.foreseen.outcomes(msg.round) if logged else []
        if msg.verify_s > 0 and len(ctx.last_block) and msg.drafts is None:  # a verify of our block, not a plain step
            self.verify.observe(msg.verify_s)
        if msg.drafts is not None:  # the target drafted that block itself (prompt lookup): not ours to learn from
            ctx.last_block = Draft(list(msg.drafts))
        elif self.lengths is not None:  # before absorb: last_block is the block that was verified
            block = ctx.last_block
            price_s = msg.verify_s if msg.verify_share_s is None else msg.verify_share_s
            self.lengths[ctx.proposer].observe(len(block), msg.accepted, price_s, block.confidence)
        ctx.absorb(msg.accepted, msg.bonus, msg.hidden, msg.linear_states)
        self.commit(ctx)
        ctx.round = msg.round
        proposer = self.strategies.get(msg.strategy)
        ctx.pipelined = msg.strategy == Strategy.PIPELINED
        if proposer is None:  # "ar" or "ngram": the target takes the round alone; our foresight has stopped
            if msg.catch_up and self.proposer.supports_foresight:
                self.catch_ups.append(CatchUp(msg.req_id, msg.round))  # DrafterIdle once it is done
            else:
                self.send_to_target.send(DrafterIdle(req_id=msg.req_id, round=msg.round))
            return None
        ctx.proposer = proposer.name
        t0 = time.perf_counter()
        entry = ctx.foreseen.take(msg.round, msg.accepted, msg.bonus) if ctx.pipelined else None
        if logged:
            self.round_log.outcome(msg.req_id, msg.round, verified, msg.accepted, msg.bonus, predicted, entry,
                                   msg.verify_s)
        if entry is None:
            return BlockAsk(ctx, proposer, msg.max_drafts, t0)
        aligned = len(entry.confidence) == len(entry.tokens)  # refined rows carry none
        draft = Draft(list(entry.tokens), list(entry.confidence) if aligned else []).prefix(msg.max_drafts)
        self.send_block(BlockAsk(ctx, proposer, msg.max_drafts, t0), draft, entry)
        return None

    def answer(self, asks: list[BlockAsk]) -> None:
        """Draft the blocks `asks` want (one proposer): in one batch when it can, and send them."""
        proposer = asks[0].proposer
        lengths = [self.draft_length(a.ctx, a.max_drafts, a.ctx.round) for a in asks]
        drafts = None
        if len(asks) > 1:
            try:
                drafts = [d.prefix(n) for d, n in zip(proposer.propose_batch([a.ctx for a in asks], lengths), lengths)]
            except Exception:  # drafted one by one below, where a failure costs only its own request's drafts
                log.exception("batched drafting for %d requests failed; drafting one by one", len(asks))
        if drafts is None:
            drafts = [self.propose(proposer, a.ctx, n) for a, n in zip(asks, lengths)]
        for ask, draft in zip(asks, drafts):
            self.send_block(ask, draft, None)

    def send_block(self, ask: BlockAsk, draft: Draft, entry) -> None:
        """Send the prefix of `draft` worth verifying (`entry`: the cache entry it came from, on a hit) and,
        in a pipelined round, queue foresight for it."""
        ctx = ask.ctx
        if ctx.banned:  # drafts after a banned token are never verified
            draft = draft.prefix(drafts_before_banned(draft.tokens, ctx.banned))
        ctx.last_block = draft = self.verify_prefix(ctx, draft, time.perf_counter() - ask.started)
        self.send_to_target.send(DraftBlock(
            req_id=ctx.req_id, round=ctx.round, tokens=draft.tokens,
            cache_hit=(entry is not None) if ctx.pipelined else None,
            passes=entry.passes if entry else 0, refreshes=entry.refreshes if entry else 0))
        if ctx.pipelined and len(draft):
            self.jobs.append(ForesightJob(ctx.req_id, ctx.round, ask.max_drafts))

    def propose(self, proposer: Proposer, ctx: DraftContext, max_drafts: int) -> Draft:
        """A fresh block with the proposer's confidence in each token (empty: it gives none)."""
        try:
            return proposer.propose(ctx, max_drafts).prefix(max_drafts)
        except Exception:  # a failing proposal costs this round its drafts, never the request
            log.exception("request %s: drafting failed; this round goes without drafts", ctx.req_id)
            return Draft()

    def draft_length(self, ctx: DraftContext, max_drafts: int, round_: int) -> int:
        """Drafts worth drafting for request round `round_` (all without the verify-length controller)."""
        return max_drafts if self.lengths is None else self.lengths[ctx.proposer].draft_length(max_drafts, round_)

    def verify_prefix(self, ctx: DraftContext, draft: Draft, draft_s: float) -> Draft:
        """The prefix of the block worth verifying. `draft_s`: drafting time the target waited for, paid
        whatever the length."""
        if self.lengths is None or not len(draft):
            return draft
        return draft.prefix(self.lengths[ctx.proposer].choose(len(draft), draft.confidence, ctx.round, fixed_s=draft_s))

    def message_waiting(self) -> bool:
        """A message from the target waits: foresight stops between stages for it (`foresee`'s `stop`)."""
        return bool(self.recv_from_target.socket.poll(0, zmq.POLLIN))

    def live(self, job: ForesightJob) -> DraftContext | None:
        """The job's request context, unless the job is stale: released, or its outcome already arrived (the
        target was faster than us)."""
        ctx = self.contexts.get(job.req_id)
        return ctx if ctx is not None and ctx.round == job.round else None

    def run_jobs(self) -> None:
        """Run the queued foresight: all live jobs in one `foresee_batch` (a batched target step reports its
        requests' outcomes at once, so their jobs queue together)."""
        jobs = {job.req_id: job for job in self.jobs if self.live(job)}  # the newest per request
        self.jobs.clear()
        if len(jobs) == 1:
            self.run_foresight(*jobs.values())
        elif jobs:
            self.run_foresight_batch(list(jobs.values()))

    def run_foresight(self, job: ForesightJob) -> None:
        """Pre-draft for the outcomes of `job.round`'s block, unless that outcome already arrived. A message
        that arrives meanwhile ends the job between stages; what was drafted by then is cached."""
        ctx = self.live(job)
        if ctx is None:
            return
        stop, t0, before = StopWatch(self.message_waiting), time.perf_counter(), self.foresight_stats()
        try:
            max_drafts = self.draft_length(ctx, job.max_drafts, job.round + 1)  # the entries answer round+1
            entries = self.proposer.foresee(ctx, ctx.last_block.tokens, max_drafts, self.verify.seconds,
                                            stop, ctx.last_block.confidence)
        except Exception:
            log.exception("request %s: foresight drafting failed; the next round misses the cache", job.req_id)
            return
        ctx.foreseen.fill(job.round + 1, entries)
        self.log_foresight([job], stop, t0, before)

    def run_foresight_batch(self, jobs: list[ForesightJob]) -> None:
        """`run_foresight` for several live jobs in one `foresee_batch`. A message that arrives meanwhile ends
        the whole batch between stages. If the batch fails, its jobs run one by one, so that a request whose
        part fails misses the cache alone."""
        ctxs = [self.contexts[job.req_id] for job in jobs]
        stop, t0, before = StopWatch(self.message_waiting), time.perf_counter(), self.foresight_stats()
        try:
            max_drafts = [self.draft_length(ctx, job.max_drafts, job.round + 1) for ctx, job in zip(ctxs, jobs)]
            got = self.proposer.foresee_batch(ctxs, [ctx.last_block.tokens for ctx in ctxs], max_drafts,
                                              self.verify.seconds, stop,
                                              [ctx.last_block.confidence for ctx in ctxs])
        except Exception:
            log.exception("foresight for %d requests (%s) failed; running them one by one", len(jobs),
                          ", ".join(job.req_id for job in jobs))
            for job in jobs:
                self.run_foresight(job)
            return
        for ctx, job, entries in zip(ctxs, jobs, got):
            ctx.foreseen.fill(job.round + 1, entries)
        self.log_foresight(jobs, stop, t0, before)

    def log_foresight(self, jobs: list[ForesightJob], stop: "StopWatch", t0: float, before) -> None:
        """--round-log: how the foresight of `jobs` (run together since `t0`) went; `before`: the proposer's
        stats before it (the same object: the jobs ended before their scores were done)."""
        if self.round_log is not None:
            stats = self.foresight_stats()
            stats = stats if stats is not before else None
            for job in jobs:
                self.round_log.foresight_ran(job.req_id, job.round + 1, stop.stopped, time.perf_counter() - t0,
                                             self.verify.seconds, stats and stats.predict_s, stats and stats.draft_s)

    def foresight_stats(self):
        """The proposer's `ForesightStats` of its latest foresight call (a new object each call that scored)."""
        return getattr(self.proposer, "stats", None)

    def run_catch_up(self) -> None:
        """Go on with the oldest catch-up until a message waits or it is done; done, answer DrafterIdle (also
        when it failed: the request's next drafts absorb what is left, and the target must not wait on)."""
        job = self.catch_ups[0]
        done = True
        if (ctx := self.contexts.get(job.req_id)) is not None:
            try:
                done = self.proposer.catch_up(ctx, self.message_waiting)
            except Exception:
                log.exception("request %s: catching up on its target states failed", job.req_id)
        if done:
            self.catch_ups.popleft()
            if ctx is not None:
                self.send_to_target.send(DrafterIdle(req_id=job.req_id, round=job.round))

    def on_release(self, msg: ReleaseDraft) -> None:
        self.contexts.pop(msg.req_id, None)  # the request's state goes with its context
        if self.round_log is not None:
            self.round_log.release(msg.req_id)

    def on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True


def calibration_source(proposer) -> str | None:
    """What the foresight scores were calibrated on (None: no foresight, or uncalibrated Eq. 6 scores)."""
    calibration = getattr(proposer, "calibration", None)
    return calibration.source or "unnamed" if calibration is not None else None


def main(cfg_dict: dict, addrs_dict: dict) -> None:
    """Process entry point (spawned by the launcher)."""
    prepare_worker_process()
    cfg = EngineConfig.from_dict(cfg_dict)
    addrs = WorkerAddresses.from_dict(addrs_dict)
    pin_worker(cfg, "drafter")  # before torch starts its threads: they inherit the cores
    torch.set_num_threads(cfg.drafter_threads)
    ctx = zmq.Context()
    with worker_lifetime(ctx, addrs, "drafter"):
        DrafterWorker(cfg, addrs, make_proposer(cfg), ctx).run()
