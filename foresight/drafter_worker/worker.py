"""The drafter worker process: keeps each request's draft context and answers outcomes with blocks.

Sync mode: each `Outcome` is absorbed into the request's context and answered with a fresh block.
Pipelined mode (foresight drafters) will pre-draft while the target verifies; the loop already
keeps drafting off the socket edges so that work can slot in between messages.
"""
from __future__ import annotations

import os
import time
import traceback

import torch
import zmq

from ..config import EngineConfig
from ..protocol.addresses import WorkerAddresses
from ..protocol.messages import DraftBlock, Outcome, ReleaseDraft, Shutdown, StartDraft, WorkerReady
from ..protocol.sockets import MessageSocket
from ..protocol.liveness import report_death
from .ngram import NgramProposer
from .proposer import DraftContext, Proposer

IDLE_POLL_MS = 100


def make_proposer(cfg: EngineConfig) -> Proposer:
    """A checkpoint folder (or, for `auto`, the shipped drafter of the embedded default) -> JetSpec; else ngram."""
    from .jetspec_proposer import JetSpecProposer, resolve_drafter_path

    path = resolve_drafter_path(cfg)
    if path is None:
        return NgramProposer(cfg.ngram_max, cfg.ngram_min)
    return JetSpecProposer.from_config(path, cfg)


class DrafterWorker:
    def __init__(self, cfg: EngineConfig, addrs: WorkerAddresses, proposer: Proposer, ctx: zmq.Context):
        self.cfg = cfg
        self.proposer = proposer
        self.recv_from_target = MessageSocket(ctx, zmq.PULL, addrs.target_to_drafter, bind=False)
        self.send_to_target = MessageSocket(ctx, zmq.PUSH, addrs.drafter_to_target, bind=False)
        self.send_to_api = MessageSocket(ctx, zmq.PUSH, addrs.workers_to_api, bind=False)
        self.contexts: dict[str, DraftContext] = {}
        self.stopping = False
        self.handlers = {
            StartDraft: self.on_start,
            Outcome: self.on_outcome,
            ReleaseDraft: self.on_release,
            Shutdown: self.on_shutdown,
        }

    def run(self) -> None:
        self.send_to_api.send(WorkerReady(worker="drafter", pid=os.getpid(), info={
            "proposer": self.proposer.name, "hidden_layers": self.proposer.hidden_layers,
            "supports_foresight": self.proposer.supports_foresight}))
        while not self.stopping:
            msg = self.recv_from_target.recv(timeout_ms=IDLE_POLL_MS)
            if msg is not None:
                self.handlers[type(msg)](msg)

    def on_start(self, msg: StartDraft) -> None:
        hidden = [msg.hidden] if msg.hidden is not None else []
        self.contexts[msg.req_id] = DraftContext(req_id=msg.req_id, tokens=list(msg.prompt_ids), seed=msg.seed,
                                                 hidden=hidden)

    def on_outcome(self, msg: Outcome) -> None:
        ctx = self.contexts.get(msg.req_id)
        if ctx is None:
            return  # released meanwhile
        ctx.absorb(msg.accepted, msg.bonus, msg.hidden)
        ctx.round = msg.round
        t0 = time.perf_counter()
        try:
            tokens = self.proposer.propose(ctx, msg.max_drafts)[: msg.max_drafts]
        except Exception:  # a failing proposal costs this round its drafts, never the request
            traceback.print_exc()
            tokens = []
        ctx.last_block = tokens
        self.send_to_target.send(DraftBlock(req_id=msg.req_id, round=msg.round, tokens=tokens,
                                            draft_s=time.perf_counter() - t0))

    def on_release(self, msg: ReleaseDraft) -> None:
        self.contexts.pop(msg.req_id, None)

    def on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True


def main(cfg_dict: dict, addrs_dict: dict) -> None:
    """Process entry point (spawned by the launcher)."""
    cfg = EngineConfig.from_dict(cfg_dict)
    addrs = WorkerAddresses.from_dict(addrs_dict)
    torch.set_num_threads(cfg.drafter_threads)
    ctx = zmq.Context()
    try:
        DrafterWorker(cfg, addrs, make_proposer(cfg), ctx).run()
    except BaseException as exc:
        report_death(ctx, addrs, "drafter", exc)
        raise
    finally:
        ctx.destroy(linger=0)
