"""The target worker process: owns the truth and drives the round loop.

One busy loop: drain the api and drafter sockets, pick the next request that can make progress
(round-robin), run one step of it (prefill, or verify one block), send what was committed.
A request that raises fails alone; an error outside a request's step kills the worker, which
tells the api with `WorkerDead` first.

What the drafter is told and answers, and what happens while it is down: `drafter_link.py`.

Each round of a request runs one strategy (`protocol.kinds.Strategy`), named in the `Outcome` that asks for its
block: the one the round planner decides (`control/round_planner.py`: the request's mode, or in mode `auto` the
best measured goodput, unless load or a catch-up holds the round to the target). Two strategies need no drafter:
"ar" (a plain step) and "ngram" (prompt lookup, run here: `local_lookup.py`). An `auto` round that runs one of them
still tells the drafter its outcome (so the drafter's context stays current) but waits for no block.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from contextlib import contextmanager

import torch
import zmq

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.kinds import LOCAL_STRATEGIES, Mode, Strategy
from ..protocol.messages import (
    AbortRequest,
    DrafterStatus,
    GenerateRequest,
    HiddenLayout,
    RequestFailed,
    RoundStats,
    Shutdown,
    TokenLogprobs,
    TokenOutput,
    WorkerReady,
)
from ..protocol.liveness import Heartbeats, prepare_worker_process, worker_lifetime
from ..placement import pin_worker
from ..protocol.sockets import MessageSocket
from ..models.compiled_step import compiled_step_for
from ..models.quantization import apply_quantization
from ..models.cpu_linear import use_cpu_linears
from ..models.loading import cache_root, load_target, load_tokenizer, resolve_dtype, resolve_target
from .packed_step import packed_attention
from .small_attention import SMALL_QUERY
from ..spec.sampling import PositionDraws
from .drafter_link import DrafterLink
from .local_lookup import LocalLookup
from .request_state import RequestState
from .runner import TargetRunner
from .step_threads import StepThreads
from .tensor_parallel import split_target
from .logit_rules import LogitRules
from .logprobs import committed_logprobs, prompt_chunk_logprobs
from .grammar import GrammarError, GrammarState, grammar_tokenizer
from .shared_prefill import prefill_twins, take_prefill
from .steps import Round, StepPlan, decided_by_argmax, eos_ids, last_row, ruled, take_verdict, verify_block
from ..control.round_planner import RoundPlanner

log = logging.getLogger("foresight.target")

IDLE_POLL_MS = 100
CONTROLLER_STATS_S = 1.0  # how often the round planner's figures go to the api (ControllerStats) while serving
# What the api hears of an unexpected failure; the details go to this worker's log with the request id.
INTERNAL_ERROR = "internal error in the target worker"
# What a prompt-lookup drafter offers (`drafter_worker.strategies`); the drafter reports its own in WorkerReady.
NGRAM_STRATEGIES = (Strategy.SYNC,)


class TargetWorker:
    def __init__(self, cfg: EngineConfig, addrs: WorkerAddresses, runner: TargetRunner, ctx: zmq.Context,
                 eos_token_ids: list[int], max_model_len: int, strategies: tuple[Strategy, ...] = NGRAM_STRATEGIES,
                 auto_strategies: tuple[Strategy, ...] = (), threads: StepThreads | None = None, tokenizer=None):
        """`strategies`: the drafting strategies the drafter offers; `auto_strategies`: those of them mode auto
        picks from (besides local prompt lookup, "ngram"); `threads`: sets the thread count of each step
        (the worker process; None leaves torch's setting alone, as a worker run in a thread must); `tokenizer`:
        the target's (Hugging Face), for requests with a grammar (None: such requests fail with a 400)."""
        self.cfg = cfg
        self.threads = threads
        # Parsed here: they come as the drafter's ready message names them (strings).
        offered = tuple(Strategy.parse(s, "strategies") for s in strategies)
        self.strategies = LOCAL_STRATEGIES + tuple(s for s in offered if s not in LOCAL_STRATEGIES)
        auto = tuple(Strategy.parse(s, "auto_strategies") for s in auto_strategies)
        self.lookup = LocalLookup(cfg)
        self.runner = runner
        self.batching = cfg.batched_steps and runner.batches_requests
        if cfg.batched_steps and not self.batching:
            log.info("batched steps off: the target has sliding-window or linear-attention layers, whose caches "
                     "cannot share a packed forward, or attends with %r rather than SDPA; one request per forward",
                     runner.config._attn_implementation)
        self.planner = RoundPlanner(auto, cfg.hybrid_min_match, self.batching)  # what each round runs
        self.stats_sent_at, self.stats_pending = 0.0, False  # when the last ControllerStats went; steps since
        self.prefills_shared = 0  # requests that started from another's prefill of the same prompt
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self._grammar_tokenizer = None  # llguidance's view of `tokenizer`, made at the first grammar (~0.3 s)
        self.max_model_len = max_model_len
        self.recv_from_api = MessageSocket(ctx, zmq.PULL, addrs.api_to_target, bind=False)
        self.send_to_api = MessageSocket(ctx, zmq.PUSH, addrs.workers_to_api, bind=False)
        self.requests: OrderedDict[str, RequestState] = OrderedDict()
        self.link = DrafterLink(ctx, addrs, runner, self.requests, self.max_drafts)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_api.socket, zmq.POLLIN)
        self.poller.register(self.link.recv_socket.socket, zmq.POLLIN)
        self.seed_rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.stopping = False
        self.heartbeats = Heartbeats(ctx, addrs.workers_to_api, "target")
        self.handlers = {
            GenerateRequest: self.on_generate,
            AbortRequest: self.on_abort,
            Shutdown: self.on_shutdown,
            DrafterStatus: self.link.on_status,
        }

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.send_to_api.send(WorkerReady(worker="target", pid=os.getpid(), info={
            "max_model_len": self.max_model_len, "vocab_size": self.runner.vocab_size,
            "compiled": self.runner.compile_info()}))
        with self.heartbeats:
            self.loop()

    def loop(self) -> None:
        while not self.stopping:
            self.heartbeats.turn()
            self.drain(self.recv_from_api)
            self.link.drain()
            plan = self.plan_step()
            if plan is None:
                self.report_controllers(idle=True)
                t0 = time.perf_counter()
                self.poller.poll(IDLE_POLL_MS)
                self.charge_idle(time.perf_counter() - t0)
                continue
            if self.threads is not None:
                t0 = time.perf_counter()
                self.threads.use(drafter_busy=self.link.still_busy(self.threads.borrowable))
                for state in plan.rounds:  # a switch's wait for DrafterIdle is its rounds' time
                    state.waited_s += (time.perf_counter() - t0) / len(plan.rounds)
            self.run_step(plan)
            self.planner.step_done(s.mode for s in self.requests.values())
            self.stats_pending = True
            self.report_controllers()

    def report_controllers(self, idle: bool = False) -> None:
        """The round planner's figures to the api (for Prometheus), when steps ran since the last report: every
        CONTROLLER_STATS_S while serving, and once no request runs (`idle`: the loop found nothing to do; a round
        that waits for its block is not the end of the work, and the report must not delay the block's poll)."""
        now = time.perf_counter()
        if self.stats_pending and ((idle and not self.requests) or now - self.stats_sent_at >= CONTROLLER_STATS_S):
            self.send_to_api.send(self.planner.stats())
            self.stats_sent_at, self.stats_pending = now, False

    def charge_idle(self, seconds: float) -> None:
        """The target idled `seconds`: a cost of the rounds whose blocks it waited for, shared among them."""
        waiting = [s for s in self.requests.values() if s.prefilled and s.awaits_block() and s.block is None]
        for state in waiting:
            state.waited_s += seconds / len(waiting)

    def drain(self, sock: MessageSocket) -> None:
        while (msg := sock.recv_nowait()) is not None:
            self.handlers[type(msg)](msg)

    def plan_step(self) -> StepPlan | None:
        """What the next step runs. Batched: every ready request's round in one forward, then the oldest
        pending prompt's next chunk. Otherwise one request, round-robin: its prefill chunk or its round."""
        if not self.batching:
            state = self.next_ready()
            return None if state is None else StepPlan.of(state)
        ready = [s for s in self.requests.values() if s.ready()]
        rounds = [s for s in ready if s.prefilled]
        prefill = next((s for s in ready if not s.prefilled), None)
        return StepPlan(rounds, prefill) if rounds or prefill is not None else None

    def next_ready(self) -> RequestState | None:
        """Round-robin: the first ready request is moved to the back of the queue."""
        for req_id, state in self.requests.items():
            if state.ready():
                self.requests.move_to_end(req_id)
                return state
        return None

    def step(self, state: RequestState) -> None:
        """One step of one request alone: its next prefill chunk, or its round."""
        self.run_step(StepPlan.of(state))

    def run_step(self, plan: StepPlan) -> None:
        chunk = plan.prefill if plan.prefill is not None and plan.prefill.req_id in self.requests else None
        if plan.rounds:
            self.run_rounds(plan.rounds, chunk)
        elif chunk is not None:
            self.guarded(chunk, self.prefill, chunk, self.cfg.max_num_batched_tokens)

    def guarded(self, state: RequestState, fn, *args) -> None:
        """Run one request's part of a step; if it raises, that request fails alone."""
        try:
            fn(*args)
        except Exception:  # one request's failure must not take the worker down
            self.fail(state)

    def fail(self, state: RequestState) -> None:
        """End a request whose step raised (called from the handler: the traceback goes to the log)."""
        log.exception("request %s failed in the target worker", state.req_id)
        self.drop(state.req_id)
        self.send_to_api.send(RequestFailed(req_id=state.req_id, error=INTERNAL_ERROR))

    # ------------------------------------------------------------------ handlers

    def on_generate(self, req: GenerateRequest) -> None:
        mode = req.mode or self.cfg.mode  # both parsed already (GenerateRequest, EngineConfig)
        if mode != Mode.AUTO and mode not in self.strategies:
            offered = ", ".join((Mode.AUTO, *self.strategies))
            self.send_to_api.send(RequestFailed(req_id=req.req_id, status=400,
                                                error=f"mode {mode.value!r} is not offered by this drafter; "
                                                      f"choose from {offered} (pipelined needs foresight, "
                                                      f"hybrid a draft model)"))
            return
        seed = req.sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_rng))
        strategy = Strategy(mode) if mode in LOCAL_STRATEGIES else Strategy.AR  # the first round's
        try:
            grammar = self.grammar_of(req)
        except Exception as exc:  # the api validated it: this is a grammar its matcher cannot start from
            log.warning("request %s: its grammar was refused: %s", req.req_id, exc)
            self.send_to_api.send(RequestFailed(req_id=req.req_id, status=400, error=f"response_format: {exc}"))
            return
        self.requests[req.req_id] = RequestState(request=req, mode=mode, draws=PositionDraws(seed), strategy=strategy,
                                                 rules=LogitRules.of(req.sampling, req.prompt_ids, self.stop_ids(req)),
                                                 grammar=grammar)

    def grammar_of(self, req: GenerateRequest) -> GrammarState | None:
        """The request's grammar state (None: it has none)."""
        if req.sampling.grammar is None:
            return None
        if self.tokenizer is None:
            raise GrammarError("this worker was started without the tokenizer structured output needs")
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return GrammarState(self._grammar_tokenizer, req.sampling.grammar, self.runner.vocab_size)

    def on_abort(self, msg: AbortRequest) -> None:
        if msg.req_id in self.requests:
            self.drop(msg.req_id)

    def on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    # ------------------------------------------------------------------ one step of a request

    def prefill(self, state: RequestState, budget: int) -> None:
        """Feed the prompt's next chunk of at most `budget` tokens in a forward of its own (with every position's
        logits when the prompt's logprobs are wanted)."""
        chunk = self.next_chunk(state, budget)
        keep = len(chunk) if state.request.sampling.prompt_logprobs is not None else 1
        self.chunk_done(state, chunk, self.runner.prefill(state.cache, chunk, keep_logits=keep))

    def next_chunk(self, state: RequestState, budget: int) -> list[int]:
        """The prompt's next at most `budget` tokens, not yet fed (its cache is made here)."""
        if state.cache is None:
            state.cache = self.runner.new_cache()
        return state.request.prompt_ids[state.prefill_pos: state.prefill_pos + budget]

    def chunk_done(self, state: RequestState, chunk: list[int], result) -> None:
        """`chunk` went into the cache (`result`: its forward's, logits of its last position, or of every one when
        the prompt's logprobs are wanted); after the prompt's last chunk, commit the first token and start the
        drafter on the request."""
        req = state.request
        if req.sampling.prompt_logprobs is not None:
            state.prompt_logprobs.append(prompt_chunk_logprobs(result, req.prompt_ids, state.prefill_pos, len(chunk),
                                                               req.sampling.prompt_logprobs, self.runner.head))
            result = last_row(result)
        state.prefill_pos += len(chunk)
        if result.hidden is not None:
            state.prefill_hidden.append(result.hidden)
        if not state.prefilled:
            return
        hidden = torch.cat(state.prefill_hidden) if state.prefill_hidden else None  # [prompt, n_layers * hidden]
        state.prefill_hidden = []
        twins = prefill_twins(state, self.requests.values())
        for twin in twins:  # before anything of `state` moves on: its cache holds exactly the prompt
            take_prefill(twin, state, self.runner)
        self.prefills_shared += len(twins)
        for s in [state, *twins]:
            self.guarded(s, self.start_generating, s, result, hidden)

    def start_generating(self, state: RequestState, result, hidden: torch.Tensor | None) -> None:
        """The prompt is in the cache (`result`: the logits of its last position; `hidden` [prompt, width]: its
        target states): commit the first token and start the drafter on the request."""
        req = state.request
        if req.max_tokens == 0:  # scoring the prompt only (echo): nothing to generate
            self.finish_unstarted(state)
            return
        decided = ruled(state, result, [], self.runner.head)
        verdict = verify_block(decided, [], req.sampling, state.draws, len(req.prompt_ids))
        take_verdict(state, verdict)
        logprobs = self.round_logprobs(state, result, decided, [verdict.token])
        if state.mode not in LOCAL_STRATEGIES:
            self.link.start(state, hidden)
        self.planner.start(state, req.sampling.temperature, req.prompt_ids + [verdict.token])
        self.commit(state, [verdict.token], accepted=0, stats=None, hidden=None, prefill=True, logprobs=logprobs)

    def finish_unstarted(self, state: RequestState) -> None:
        """End a request that asked for no tokens (max_tokens 0) once its prompt is in: its prompt's logprobs."""
        self.send_to_api.send(TokenOutput(req_id=state.req_id, token_ids=[], finished=True, finish_reason="length",
                                          prompt_tokens=len(state.request.prompt_ids),
                                          prompt_logprobs=state.take_prompt_logprobs()))
        self.drop(state.req_id)

    def round_logprobs(self, state: RequestState, result, decided: torch.Tensor, committed: list[int]):
        """The logprobs of a round's committed tokens (`decided`: the logits its verification took), if the
        request wants them (else None)."""
        if state.request.sampling.logprobs is None:
            return None
        return committed_logprobs(result, decided, committed, state.request.sampling, self.runner.head,
                                  self.cfg.logprobs_mode)

    def run_rounds(self, states: list[RequestState], chunk_state: RequestState | None = None) -> None:
        """Verify the blocks of `states`' rounds and feed `chunk_state`'s next prompt chunk: in one forward
        when batching, else one forward each."""
        rounds = []
        for state in states:
            t0 = time.perf_counter()
            try:
                rounds.append(self.start_round(state))
            except Exception:
                self.fail(state)
            else:
                state.waited_s += time.perf_counter() - t0  # prompt lookup: this round's own drafting
        # The verify blocks come first; the prompt gets what is left of the step's token budget. A prompt whose
        # logprobs are wanted needs every position's logits, and compiled steps run a chunk faster alone: its
        # chunk then runs in a forward of its own.
        budget = max(self.cfg.block_size, self.cfg.max_num_batched_tokens - sum(1 + len(r.draft) for r in rounds))
        shared = chunk_state if chunk_state is not None and chunk_state.request.sampling.prompt_logprobs is None \
            and self.runner.shares_chunks else None
        if self.batching and rounds and (len(rounds) > 1 or shared is not None):
            if self.run_batched(rounds, shared, budget):
                rounds = []
                chunk_state = None if shared is not None else chunk_state
        for r in rounds:
            self.guarded(r.state, self.verify_alone, r)
        if chunk_state is not None and chunk_state.req_id in self.requests:
            self.guarded(chunk_state, self.prefill, chunk_state, budget)

    def run_batched(self, rounds: list[Round], chunk_state: RequestState | None, budget: int) -> bool:
        """One forward over `rounds`' blocks and `chunk_state`'s next chunk; False if it raised (nothing fed)."""
        chunk = self.next_chunk(chunk_state, budget) if chunk_state is not None else None
        blocks = [[r.state.anchor, *r.draft] for r in rounds]
        t0 = time.perf_counter()
        try:
            results = self.runner.verify_batch([r.state.cache for r in rounds], blocks,
                                               (chunk_state.cache, chunk) if chunk_state is not None else None)
        except Exception:  # find the request that fails, and let it fail alone
            log.exception("a batched forward failed: running its %d requests one by one",
                          len(rounds) + (chunk_state is not None))
            return False
        verify_s = time.perf_counter() - t0
        lengths = [len(block) for block in blocks] + ([len(chunk)] if chunk_state is not None else [])
        for r, result, share_s in zip(rounds, results, self.planner.shares(lengths, verify_s)):
            self.guarded(r.state, self.finish_round, r, result, verify_s, share_s)
        if chunk_state is not None:
            self.guarded(chunk_state, self.chunk_done, chunk_state, chunk, results[-1])
        return True

    def start_round(self, state: RequestState) -> Round:
        """The drafts a round verifies: the drafter's block, or the target's own (none, or prompt lookup)."""
        if not state.awaits_block():
            return Round(state, self.local_drafts(state), None, None)
        block = state.take_block()
        return Round(state, block.tokens, block, state.block_received_at - state.outcome_sent_at)

    def verify_alone(self, r: Round) -> None:
        t0 = time.perf_counter()
        result = self.runner.verify(r.state.cache, r.state.anchor, r.draft, argmax_only=decided_by_argmax(r.state))
        verify_s = time.perf_counter() - t0
        self.planner.forward_done(1 + len(r.draft), verify_s)  # alone, the round pays the whole forward
        self.finish_round(r, result, verify_s)

    def finish_round(self, r: Round, result, verify_s: float, share_s: float | None = None) -> None:
        """Apply the request's verification rule to its block's logits, crop what was rejected, commit.
        `verify_s`: the forward's time; `share_s`: this request's part of it when batched (StepCost)."""
        state, draft, req = r.state, r.draft, r.state.request
        decided = ruled(state, result, draft, self.runner.head)
        verdict = verify_block(decided, draft, req.sampling, state.draws, state.cached_positions + 1)
        take_verdict(state, verdict)
        self.runner.rollback(state.cache, len(draft) - verdict.accepted, result)
        state.last_verify_s = verify_s
        state.verify_share_s = share_s
        share_s = verify_s if share_s is None else share_s
        state.round_cost_s, state.waited_s = state.waited_s + share_s, 0.0
        stats = r.stats(verdict, verify_s, result.compiled if self.runner.compiled is not None else None)
        if not r.with_drafts:
            self.lookup.observe(len(draft), verdict.accepted, share_s)
        committed = draft[: verdict.accepted] + [verdict.token]
        hidden = result.hidden[: verdict.accepted + 1] if result.hidden is not None else None
        self.commit(state, committed, verdict.accepted, stats, hidden,
                    logprobs=self.round_logprobs(state, result, decided, committed))

    def local_drafts(self, state: RequestState) -> list[int]:
        """The drafts of a round the target runs without the drafter: none for "ar", prompt lookup for "ngram"."""
        if state.strategy != Strategy.NGRAM:
            return []
        return self.lookup.propose(state.request.prompt_ids + state.output_ids, self.max_drafts(state), state.round,
                                   state.rules.banned if state.rules is not None else frozenset())

    def commit(self, state: RequestState, tokens: list[int], accepted: int, stats: RoundStats | None,
               hidden: torch.Tensor | None, prefill: bool = False, logprobs: TokenLogprobs | None = None) -> None:
        """Append committed tokens up to the first stop condition, report them (with their `logprobs`, when
        wanted), ask for the next block.

        `stats` is None for the prefill, which commits its first token without verifying a block."""
        emitted, reason = self.apply_stops(state, tokens)
        self.planner.committed(len(emitted))
        self.send_to_api.send(TokenOutput(
            req_id=state.req_id, token_ids=emitted, finished=reason is not None, finish_reason=reason,
            rounds=[stats] if stats else [], prompt_tokens=len(state.request.prompt_ids) if prefill else 0,
            logprobs=logprobs.head(len(emitted)) if logprobs is not None else None,
            prompt_logprobs=state.take_prompt_logprobs() if prefill else None))
        if reason is not None:
            self.drop(state.req_id)
            return
        drafter_round = stats is not None and state.awaits_block()  # before the strategy moves on
        if drafter_round and state.strategy == Strategy.PIPELINED:
            state.foreseen = state.positions  # its outcome goes to the drafter's next foresight job
        state.anchor = tokens[-1]
        state.round += 1
        if state.drafting:
            state.strategy = self.planner.next_strategy(state, len(tokens) if stats else None,
                                                        state.request.prompt_ids + state.output_ids)
            self.link.tell(state, tokens, accepted, hidden, drafter_round)

    def apply_stops(self, state: RequestState, tokens: list[int]) -> tuple[list[int], str | None]:
        stop_ids = self.stop_ids(state.request)
        emitted: list[int] = []
        for tok in tokens:
            emitted.append(tok)
            state.output_ids.append(tok)
            if tok in stop_ids:
                return emitted, "stop"
            if state.tokens_left() <= 0 or self.context_left(state) <= 0:
                return emitted, "length"
        if state.grammar is not None and state.grammar.done:  # complete: only the eos could follow (or nothing)
            return emitted, "stop"
        return emitted, None

    def stop_ids(self, req: GenerateRequest) -> set[int]:
        """The tokens that end `req`: its stop token ids, and eos unless it ignores eos."""
        return set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.eos_token_ids))

    def context_left(self, state: RequestState) -> int:
        return self.max_model_len - len(state.request.prompt_ids) - len(state.output_ids)

    def max_drafts(self, state: RequestState) -> int:
        """Never draft past max_tokens or the context window: a block commits at most drafts + 1 tokens."""
        return max(0, min(self.cfg.gamma, state.tokens_left() - 1, self.context_left(state)))

    def drop(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.link.release(state)


def prompt_chunk_tokens(cfg: EngineConfig) -> tuple[int, int]:
    """The prompt chunks of one request the compiled prompt-chunk graph takes: past the short queries whose
    attention folds its heads (small_attention.py: another path, another graph) up to the chunk budget."""
    return SMALL_QUERY + 1, cfg.max_num_batched_tokens


def main(cfg_dict: dict, addrs_dict: dict, layout_dict: dict, strategies: list[str],
         auto_strategies: list[str]) -> None:
    """Process entry point (spawned by the launcher). `layout_dict`: the drafter's `HiddenLayout`, as a dict."""
    prepare_worker_process()
    cfg = EngineConfig.from_dict(cfg_dict)
    addrs = WorkerAddresses.from_dict(addrs_dict)
    pin_worker(cfg, "target")  # before torch starts its threads: they inherit the cores
    torch.set_num_threads(cfg.target_threads)
    ctx = zmq.Context()
    with worker_lifetime(ctx, addrs, "target"):
        path = resolve_target(cfg.target)
        layout = HiddenLayout(**layout_dict)
        threads = StepThreads.from_config(cfg)
        with target_runner(cfg, path, layout, threads) as runner:
            model = runner.model
            max_len = cfg.max_model_len or model.config.max_position_embeddings
            TargetWorker(cfg, addrs, runner, ctx, eos_ids(model), max_len, tuple(strategies),
                         tuple(auto_strategies), threads, tokenizer=load_tokenizer(path)).run()


@contextmanager
def target_runner(cfg: EngineConfig, path, layout: HiddenLayout, threads: StepThreads):
    """The target's runner for the worker's life: on one device (quantized, compiled as configured), or split over
    `cfg.tensor_parallel_size` ranks (tensor_parallel.py: eager, dense)."""
    if cfg.tensor_parallel_size > 1:
        with split_target(cfg, path, layout) as runner:
            yield runner
        return
    model = load_target(path, resolve_dtype(cfg.dtype, cfg.target_device), cfg.target_device)
    apply_quantization(model, cfg.quantization, path, cfg.target_device, "target")
    use_cpu_linears(model, cfg.cpu_linear, cfg.target_device, "target")
    compiled = compiled_step_for(model, cfg.compile, cfg.target_device, layout.layers, cfg.block_size,
                                 cache_root() / "compiled", packed_attention, "target", threads.most,
                                 batched=cfg.batched_steps, chunk_tokens=prompt_chunk_tokens(cfg))
    yield TargetRunner(model, layout, compiled=compiled)
