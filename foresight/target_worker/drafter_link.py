"""The target's side of the drafter: what it tells the drafter of each request, and what it hears back.

The drafter is optional to correctness: every committed token is the target's own verdict. While the drafter is
down (`DrafterStatus(up=False)` from the supervisor) requests take plain one-token steps instead of waiting; they
stay on plain steps until they end, because a restarted drafter has lost their contexts. Requests that start once
it is back (`DrafterStatus(up=True)`) draft.

Per request the drafter hears `StartDraft` once the prompt is in, an `Outcome` for each round that wants a block
(or ends a block's foresight), `ReleaseDraft` at the end; it answers `DraftBlock` for a round's block and
`DrafterIdle` once it stopped working for a request that switched to a round the target runs alone.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable

import torch
import zmq

from ..control.round_planner import Hold
from ..protocol.addresses import WorkerAddresses
from ..protocol.messages import DraftBlock, DrafterIdle, DrafterStatus, Outcome, ReleaseDraft, StartDraft
from ..protocol.sockets import MessageSocket
from ..protocol.transport import default_transport
from .request_state import RequestState
from .runner import TargetRunner
from .steps import drafter_seed
from .step_threads import drafter_busy, winding_down_only

log = logging.getLogger("foresight.target")

WIND_DOWN_WAIT_MS = 2  # see still_busy


class DrafterLink:
    def __init__(self, ctx: zmq.Context, addrs: WorkerAddresses, runner: TargetRunner,
                 requests: OrderedDict[str, RequestState], max_drafts: Callable[[RequestState], int]):
        """`requests`: the target worker's running requests (the link reads and updates their drafter fields);
        `max_drafts`: the most drafts a request's next round may verify."""
        self.runner = runner
        self.requests = requests
        self.max_drafts = max_drafts
        # Connecting, not binding: messages wait in its queue while a (re)started drafter binds, instead of
        # a send that blocks or fails for want of a peer.
        self.send_socket = MessageSocket(ctx, zmq.PUSH, addrs.target_to_drafter, bind=False)
        self.recv_socket = MessageSocket(ctx, zmq.PULL, addrs.drafter_to_target, bind=True)
        self.up = True  # the supervisor starts the drafter first and says when it goes down
        self.handlers = {DrafterStatus: self.on_status, DraftBlock: self.on_block, DrafterIdle: self.on_idle}

    def send(self, msg) -> bool:
        """Send to the drafter, never blocking on it: False while it is down, or if its queue is full."""
        return self.up and self.send_socket.send(msg, block=False)

    def drain(self) -> None:
        while (msg := self.recv_socket.recv_nowait()) is not None:
            self.handlers[type(msg)](msg)

    # ------------------------------------------------------------------ what the drafter and supervisor say

    def on_status(self, msg: DrafterStatus) -> None:
        if msg.up:
            log.info("the drafter is back: new requests draft again")
            self.up = True
        else:
            self.lost(msg.reason or "the supervisor says it is down")

    def lost(self, reason: str) -> None:
        """Stop waiting for the drafter: every drafting request goes on with plain steps."""
        log.warning("drafter down (%s): running requests go on without drafts", reason)
        self.up = False
        for state in self.requests.values():
            state.detach()
        self.send_socket.reset()  # what waits in the queue was meant for the dead drafter
        default_transport().peer_lost()  # CUDA slots it held are never acknowledged

    def on_block(self, block: DraftBlock) -> None:
        state = self.requests.get(block.req_id)
        if state is None or not state.awaits_block() or block.round != state.round or state.block is not None:
            return  # stale: an older round, a request that ended or went on without the drafter
        state.block = replace(block, tokens=block.tokens[: self.max_drafts(state)])
        state.block_received_at = time.perf_counter()

    def on_idle(self, msg: DrafterIdle) -> None:
        state = self.requests.get(msg.req_id)
        if state is not None and state.drafter_winding_down == msg.round:
            state.drafter_winding_down = 0
            if state.hold == Hold.CATCH_UP_ASKED:  # the catch-up's Outcome was this round's
                state.hold = Hold.CATCH_UP_DONE

    # ------------------------------------------------------------------ what the target tells it

    def start(self, state: RequestState, hidden: torch.Tensor | None) -> None:
        """The prompt is in (`hidden` [prompt, width]: its target states): the drafter takes the request's context."""
        req = state.request
        state.drafting = self.send(StartDraft(
            req_id=req.req_id, prompt_ids=req.prompt_ids, seed=drafter_seed(state.draws.seed),
            temperature=req.sampling.temperature, refinement=req.refinement, hidden=hidden, sampling=req.sampling,
            linear_states=self.runner.linear_states(state.cache, state.prefill_pos)))

    def tell(self, state: RequestState, tokens: list[int], accepted: int, hidden: torch.Tensor | None,
             drafter_round: bool) -> None:
        """Report a drafter round's outcome at once, as (accepted, bonus) of its own block: the next round
        wants a block, or runs without the drafter, and then the message also ends the foresight job the
        block started (it would run on beside the target's steps). Rounds the drafter did not draft are
        kept and reported as the tokens it has not seen (`Outcome.drafts` + bonus) with the next round that
        wants a block, or that asks it to catch up."""
        catch_up = state.hold == Hold.CATCH_UP_DUE
        if drafter_round and not state.unsent:
            outcome = dict(accepted=accepted, hidden=hidden, drafts=None)
        else:
            state.unsent += tokens
            if hidden is not None:
                state.unsent_hidden.append(hidden)
            if not state.awaits_block() and not catch_up:
                return  # a plain or prompt-lookup round next: the drafter need not wake
            outcome = dict(accepted=len(state.unsent) - 1, drafts=state.unsent[:-1],
                           hidden=torch.cat(state.unsent_hidden) if state.unsent_hidden else None)
            state.unsent, state.unsent_hidden = [], []
        state.outcome_sent_at = time.perf_counter()
        if not self.send(Outcome(req_id=state.req_id, round=state.round, bonus=state.anchor,
                                 max_drafts=self.max_drafts(state), verify_s=state.last_verify_s,
                                 verify_share_s=state.verify_share_s, strategy=state.strategy,
                                 linear_states=self.runner.linear_states(state.cache, state.cached_positions),
                                 catch_up=catch_up, **outcome)):
            state.detach()  # no block will come for this round
        elif not state.awaits_block():
            state.drafter_winding_down = state.round  # until its DrafterIdle: see drafter_busy
            if catch_up:
                state.hold, state.foreseen = Hold.CATCH_UP_ASKED, state.positions

    def release(self, state: RequestState) -> None:
        """The request ended: the drafter drops its context."""
        if state.drafting:
            self.send(ReleaseDraft(req_id=state.req_id))

    # ------------------------------------------------------------------ the cores it shares

    def still_busy(self, borrowable: bool) -> bool:
        """Whether the next step must leave the drafter its threads (`borrowable`: the step may borrow them).
        A request that just switched to a round the target runs alone waits up to WIND_DOWN_WAIT_MS for the
        drafter's DrafterIdle: it comes within a fraction of a millisecond after a sync or hybrid round, and then
        the step runs on both shares instead of one (a foresight job may take longer; then the step goes on
        without it)."""
        states = self.requests.values()
        if borrowable and winding_down_only(states):
            deadline = time.perf_counter() + WIND_DOWN_WAIT_MS / 1e3
            while winding_down_only(states) and (left := deadline - time.perf_counter()) > 0:
                if self.recv_socket.socket.poll(max(1, int(left * 1e3)), zmq.POLLIN):
                    self.drain()
        return drafter_busy(states)
