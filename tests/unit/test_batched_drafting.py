"""Batched drafting: outcomes that arrive together are drafted in one draft-model pass, and each request
gets the block it would get alone."""
from __future__ import annotations

import pytest
import torch
import zmq

from foresight.config import EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.drafter_worker.proposer import DraftContext
from foresight.drafter_worker.worker import DrafterWorker
from foresight.protocol.addresses import WorkerAddresses
from foresight.protocol.messages import DraftBlock, Outcome, ReleaseDraft, StartDraft
from foresight.protocol.sockets import MessageSocket
from support.tiny_models import tiny_model
from test_foresight import make_draft_model, true_states

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12, 13, 40, 41], [3, 17, 3, 17, 60]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def contexts(proposer: JetSpecProposer, target, seeds=(1, 2, 3)) -> list[DraftContext]:
    ctxs = []
    for i, (prompt, seed) in enumerate(zip(PROMPTS, seeds)):
        ctx = DraftContext(req_id=f"r{i}", tokens=list(prompt), seed=seed,
                           hidden=[true_states(target, prompt, proposer.layout.layers)[:-1]])
        proposer.add_request(ctx)
        ctxs.append(ctx)
    return ctxs


def test_propose_batch_gives_each_request_its_own_block(target):
    alone_proposer = JetSpecProposer(make_draft_model(target), passes=2)
    batch_proposer = JetSpecProposer(make_draft_model(target), passes=2)
    wanted = [7, 3, 5]  # blocks of different lengths share the pass
    for _ in range(3):  # rounds: each draws fresh noise from its request's generator
        alone = [alone_proposer.propose(ctx, n) for ctx, n in zip(contexts(alone_proposer, target), wanted)]
        together = batch_proposer.propose_batch(contexts(batch_proposer, target), wanted)
        for a, b, n in zip(alone, together, wanted):
            assert len(b) == n and b.tokens == a.tokens
            assert b.confidence == pytest.approx(a.confidence, abs=1e-5)
    assert batch_proposer.propose_batch(contexts(batch_proposer, target), [0, 0, 0])[0].tokens == []


class CountingJetSpec(JetSpecProposer):
    def __init__(self, model):
        super().__init__(model, passes=1)
        self.batches: list[int] = []

    def propose_batch(self, ctxs, max_drafts, passes=None):
        self.batches.append(len(ctxs))
        return super().propose_batch(ctxs, max_drafts, passes)


def test_outcomes_that_arrive_together_are_drafted_in_one_pass(target):
    proposer = CountingJetSpec(make_draft_model(target))
    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        from_drafter = MessageSocket(zctx, zmq.PULL, addrs.drafter_to_target, bind=True)
        worker = DrafterWorker(EngineConfig(drafter="ngram", verify_length="max"), addrs, proposer, zctx)
        for i, prompt in enumerate(PROMPTS):
            hidden = true_states(target, prompt, proposer.layout.layers)  # the prefill's: every prompt position
            worker.on_start(StartDraft(req_id=f"r{i}", prompt_ids=prompt, seed=i, hidden=hidden))
        worker.handle([Outcome(req_id=f"r{i}", round=1, accepted=0, bonus=7, max_drafts=5, strategy="sync")
                       for i in range(3)] + [ReleaseDraft(req_id="r2")])  # r2 ended before its block was drafted
        blocks = [from_drafter.recv(timeout_ms=5000) for _ in range(2)]
        assert from_drafter.recv(timeout_ms=200) is None
    finally:
        zctx.destroy(linger=0)
        addrs.remove()
    assert proposer.batches == [2]
    assert sorted(b.req_id for b in blocks) == ["r0", "r1"]
    assert all(isinstance(b, DraftBlock) and b.round == 1 and len(b.tokens) == 5 for b in blocks)


def test_hybrid_batch_looks_up_where_it_matches_and_batches_the_rest(target):
    from foresight.drafter_worker.ngram import NgramProposer
    from foresight.drafter_worker.strategies import HybridProposer

    alone = HybridProposer(JetSpecProposer(make_draft_model(target), passes=1), NgramProposer(4, 2), 3)
    together = HybridProposer(CountingJetSpec(make_draft_model(target)), NgramProposer(4, 2), 3)
    wanted = [4, 4, 4]  # PROMPTS[0] ends in a 3-gram seen before: prompt lookup drafts it
    want = [alone.propose(ctx, n) for ctx, n in zip(contexts(alone.model, target), wanted)]
    got = together.propose_batch(contexts(together.model, target), wanted)
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert got[0].confidence == [] and got[1].confidence and together.model.batches == [2]
