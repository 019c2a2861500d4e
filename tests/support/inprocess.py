"""Both worker loops in threads of the test process, talking over real ZeroMQ sockets.

Exercises the same round protocol as the spawned processes, without their start-up cost.
"""
from __future__ import annotations

import itertools
import threading
import time

import zmq

from foresight.config import EngineConfig
from foresight.drafter_worker.strategies import auto_strategies
from foresight.drafter_worker.worker import DrafterWorker, make_proposer
from foresight.protocol.addresses import WorkerAddresses
from foresight.protocol.messages import GenerateRequest, RequestFailed, SamplingParams, Shutdown, TokenOutput, WorkerReady
from foresight.protocol.sockets import MessageSocket
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.steps import eos_ids
from foresight.target_worker.worker import TargetWorker


class InProcessEngine:
    def __init__(self, model, cfg: EngineConfig | None = None, max_model_len: int | None = None, proposer=None,
                 foresight_to_completion: bool = False, compiled=None, tokenizer=None, runner=None):
        """`foresight_to_completion`: foresight jobs ignore waiting messages and run every planned stage (a
        tiny model verifies so fast that the next outcome would cut most of them short, which tests that
        count refreshes or cache hits must not depend on). `compiled`: the target's `CompiledStep`.
        `tokenizer`: the target's, for requests with a grammar. `runner`: the target's runner (default: one over
        `model` sending what the proposer reads)."""
        self.cfg = cfg or EngineConfig(drafter="ngram")
        self.addrs = WorkerAddresses.fresh()
        self.ctx = zmq.Context()
        self.send_to_target = MessageSocket(self.ctx, zmq.PUSH, self.addrs.api_to_target, bind=True)
        self.recv_from_workers = MessageSocket(self.ctx, zmq.PULL, self.addrs.workers_to_api, bind=True)
        proposer = proposer or make_proposer(self.cfg)
        self.drafter = DrafterWorker(self.cfg, self.addrs, proposer, self.ctx)
        if foresight_to_completion:
            self.drafter.message_waiting = lambda: False
        runner = runner or TargetRunner.for_proposer(model, proposer, compiled=compiled)
        self.target = TargetWorker(self.cfg, self.addrs, runner, self.ctx, eos_ids(model),
                                   max_model_len or model.config.max_position_embeddings,
                                   strategies=tuple(self.drafter.strategies),
                                   auto_strategies=tuple(auto_strategies(self.drafter.strategies)),
                                   tokenizer=tokenizer)
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in (self.drafter, self.target)]
        for t in self.threads:
            t.start()
        ready = set()
        while len(ready) < 2:  # heartbeats may come between the two ready messages
            msg = self.recv_from_workers.recv(timeout_ms=30000)
            assert msg is not None, f"ready messages missing; got {ready}"
            if isinstance(msg, WorkerReady):
                ready.add(msg.worker)
        assert ready == {"target", "drafter"}, ready
        self._ids = itertools.count()

    def submit(self, prompt: list[int], max_tokens: int, mode: str = "sync", ignore_eos: bool = False,
               **sampling) -> str:
        req_id = f"t-{next(self._ids)}"
        self.send_to_target.send(GenerateRequest(req_id=req_id, prompt_ids=list(prompt), max_tokens=max_tokens,
                                                 sampling=SamplingParams(**sampling), mode=mode, ignore_eos=ignore_eos))
        return req_id

    def collect(self, req_ids: list[str], timeout_ms: int = 60000) -> dict[str, dict]:
        """Run until every request finished or failed; per request: tokens, rounds, reason, error, the outputs'
        logprobs (TokenLogprobs each) and the prompt's."""
        results = {r: {"tokens": [], "rounds": [], "reason": None, "error": None, "logprobs": [],
                       "prompt_logprobs": None} for r in req_ids}
        pending = set(req_ids)
        deadline = time.monotonic() + timeout_ms / 1000  # moved on by every output: heartbeats are no progress
        while pending:
            dead = [name for name, t in zip(("drafter", "target"), self.threads) if not t.is_alive()]
            assert not dead, f"{dead} worker thread died (traceback above); {pending} unfinished"
            assert time.monotonic() < deadline, f"no output for {pending} in {timeout_ms} ms"
            msg = self.recv_from_workers.recv(timeout_ms=500)
            if isinstance(msg, (TokenOutput, RequestFailed)):
                deadline = time.monotonic() + timeout_ms / 1000
            if isinstance(msg, TokenOutput) and msg.req_id in results:
                res = results[msg.req_id]
                res["tokens"] += msg.token_ids
                res["rounds"] += msg.rounds
                if msg.logprobs is not None:
                    res["logprobs"].append(msg.logprobs)
                if msg.prompt_logprobs is not None:
                    res["prompt_logprobs"] = msg.prompt_logprobs
                if msg.finished:
                    res["reason"] = msg.finish_reason
                    pending.discard(msg.req_id)
            elif isinstance(msg, RequestFailed) and msg.req_id in results:
                results[msg.req_id]["error"] = msg.error
                pending.discard(msg.req_id)
            elif isinstance(msg, WorkerReady):
                continue
        return results

    def generate(self, prompt: list[int], max_tokens: int, mode: str = "sync", **sampling) -> dict:
        rid = self.submit(prompt, max_tokens, mode, **sampling)
        return self.collect([rid])[rid]

    def generate_all(self, prompts: list[list[int]], max_tokens: int, mode: str = "sync", **sampling) -> list[dict]:
        """Every prompt submitted at once (served together); the results in prompt order."""
        ids = [self.submit(prompt, max_tokens, mode, **sampling) for prompt in prompts]
        results = self.collect(ids)
        return [results[rid] for rid in ids]

    def close(self) -> None:
        drafter_thread, target_thread = self.threads
        self.send_to_target.send(Shutdown())
        target_thread.join(timeout=10)
        self.target.link.send_socket.send(Shutdown())  # safe now: the target's thread has ended
        drafter_thread.join(timeout=10)
        self.ctx.destroy(linger=0)
        self.addrs.remove()
