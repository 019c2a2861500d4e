"""The target goes on without the drafter: plain steps while it is down, exact output, drafting again
for requests that start once it is back; and it never blocks on a drafter that takes no messages."""
from __future__ import annotations

import pytest
import torch
import zmq

from foresight.spec.sampling import PositionDraws
from foresight.config import EngineConfig
from foresight.protocol.addresses import WorkerAddresses
from foresight.protocol.messages import (
    DraftBlock,
    DrafterStatus,
    GenerateRequest,
    SamplingParams,
    TokenOutput,
)
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # repeated n-grams: prompt lookup proposes drafts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def engine(model):
    # verify_length=max: every proposed draft is verified, so "drafts were used" is visible in the stats
    eng = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6, verify_length="max"))
    yield eng
    eng.close()


def run_with_drafter_down_after(engine: InProcessEngine, outputs_before_down: int, max_tokens: int) -> tuple:
    """One greedy sync request; the drafter is declared down after its first outputs."""
    req_id = engine.submit(PROMPT, max_tokens, mode="sync", temperature=0.0)
    tokens, rounds, seen = [], [], 0
    while True:
        msg = engine.recv_from_workers.recv(timeout_ms=60000)
        assert msg is not None, "no output"
        if not isinstance(msg, TokenOutput) or msg.req_id != req_id:
            continue
        tokens += msg.token_ids
        rounds += [(seen, r) for r in msg.rounds]
        seen += 1
        if seen == outputs_before_down:
            engine.send_to_target.send(DrafterStatus(up=False, reason="test"))
        if msg.finished:
            return tokens, rounds, seen


def test_drafter_down_mid_request_keeps_greedy_output_exact(model, engine):
    want = plain_greedy(model, PROMPT, 40, eos=model.config.eos_token_id)
    tokens, rounds, _ = run_with_drafter_down_after(engine, 3, 40)
    assert tokens == want
    # Once the status has arrived, rounds are plain steps (the last few certainly are).
    assert rounds[-1][1].drafted == 0 and rounds[-1][1].exposed_draft_s is None


def test_requests_while_down_run_plain_and_drafting_resumes_when_up(model, engine):
    engine.send_to_target.send(DrafterStatus(up=False, reason="test"))
    down = engine.generate(PROMPT, 30, mode="sync", temperature=0.0)
    assert down["error"] is None
    assert down["tokens"] == plain_greedy(model, PROMPT, 30, eos=model.config.eos_token_id)
    assert all(r.drafted == 0 for r in down["rounds"])
    engine.send_to_target.send(DrafterStatus(up=True))
    up = engine.generate(PROMPT, 30, mode="sync", temperature=0.0)
    assert up["tokens"] == down["tokens"]
    assert any(r.drafted > 0 for r in up["rounds"]), "a request after DrafterStatus(up) did not draft"


def test_seeded_sampling_is_reproducible_without_the_drafter(engine):
    """Sampled requests keep working on plain steps, and a seed still fixes their tokens."""
    req = dict(mode="sync", temperature=1.0, top_p=0.9, seed=99)
    engine.send_to_target.send(DrafterStatus(up=False))
    a = engine.generate(PROMPT, 25, **req)
    b = engine.generate(PROMPT, 25, **req)
    assert a["error"] is None and b["error"] is None
    assert a["tokens"] == b["tokens"]
    assert len(a["tokens"]) == 25 or a["reason"] == "stop"


def test_a_request_waiting_for_a_dead_drafter_goes_on_when_told(model):
    """No drafter process at all: the request's messages wait in the queue (nothing blocks), the request
    waits for its block, and DrafterStatus(down) lets it finish with plain steps; late blocks are ignored."""
    from foresight.target_worker.request_state import RequestState
    from foresight.target_worker.runner import TargetRunner
    from foresight.target_worker.worker import TargetWorker

    ctx = zmq.Context()
    addrs = WorkerAddresses.fresh()
    api = ctx.socket(zmq.PULL)
    api.bind(addrs.workers_to_api)
    worker = TargetWorker(EngineConfig(drafter="ngram"), addrs, TargetRunner(model), ctx,
                          eos_token_ids=[], max_model_len=256)
    try:
        request = GenerateRequest(req_id="r", prompt_ids=PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0))
        worker.requests["r"] = state = RequestState(request=request, mode="sync", draws=PositionDraws(0))
        worker.step(state)  # prefill: StartDraft and the first Outcome are queued for the drafter
        assert state.drafting and not state.ready()
        worker.link.on_status(DrafterStatus(up=False, reason="test"))
        assert not worker.link.up and not state.drafting
        while "r" in worker.requests:
            assert state.ready()
            worker.step(state)
        assert len(state.output_ids) == 6
        worker.link.on_block(DraftBlock(req_id="r", round=1, tokens=[1]))  # a late block: ignored
    finally:
        ctx.destroy(linger=0)
        addrs.remove()


def test_auto_requests_fall_back_to_local_prompt_lookup_while_the_drafter_is_down(model, engine):
    engine.send_to_target.send(DrafterStatus(up=False, reason="test"))  # same socket: handled before the request
    down = engine.generate(PROMPT, 30, mode="auto", temperature=0.0)
    engine.send_to_target.send(DrafterStatus(up=True))
    assert down["error"] is None
    assert down["tokens"] == plain_greedy(model, PROMPT, 30, eos=model.config.eos_token_id)
    assert {r.strategy for r in down["rounds"]} == {"ngram"}
    assert all(r.exposed_draft_s is None for r in down["rounds"])
