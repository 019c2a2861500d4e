"""Batched foresight: the pipelined jobs of several requests run as one `foresee_batch`, whose adapter,
decoder and draft-model stages each take one pass for all of them, and each request gets what `foresee`
gives it alone. On a tiny Llama (attention) and a tiny Qwen3.5 (Gated DeltaNet layers), float32."""
from __future__ import annotations

import pytest
import torch
import zmq

from foresight.config import EngineConfig
from foresight.drafter_worker.decoder_scorer import AdapterDecoderScorer
from foresight.drafter_worker.foresight import ForesightDrafter
from foresight.drafter_worker.proposer import Draft, DraftContext
from foresight.drafter_worker.worker import DrafterWorker
from foresight.models.adapter import Adapter
from foresight.models.decoder import ForesightDecoder
from foresight.protocol.addresses import WorkerAddresses
from foresight.protocol.messages import Outcome, StartDraft
from foresight.protocol.sockets import MessageSocket
from support.inprocess import InProcessEngine
from support.tiny_models import VOCAB, plain_greedy, tiny_model
from test_foresight import make_draft_model, true_states
from test_hybrid_decoder import snapshots, true_run

torch.set_num_threads(1)
ATOL = 1e-5
ARCHS = ["llama", "qwen3_5"]  # attention layers; Gated DeltaNet layers (the adapter's stages, the decoder's layer 2)


class RecordedFill:
    """Stands in for a request's `ForeseenBlocks`: what foresight fills in goes to `filled[req_id]`."""

    def __init__(self, req_id: str, filled: dict):
        self.req_id, self.filled = req_id, filled

    def fill(self, round_: int, entries: list) -> None:
        self.filled[self.req_id] = (round_, entries)


def sequence(seed: int, n: int = 40) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def build(target) -> ForesightDrafter:
    """Draft model (random, seeded), the adapter initialised from the target's layers, a 2-layer decoder: the
    same drafter on every call."""
    decoder = ForesightDecoder(target, 2)
    model = make_draft_model(target)
    reads = model.config.target_layers  # llama [1, 3], qwen3_5 [1, 2, 4]
    indices = sorted({i for i in reads if i < decoder.input_index} | {decoder.input_index})
    adapter = Adapter.from_target(target, indices).eval()
    return ForesightDrafter(model, AdapterDecoderScorer(model, adapter, decoder), passes=2, cache_size=3, refreshes=1,
                            refinement="anchor", use_budget=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_predicts_requests_of_different_lengths_in_one_pass(arch):
    target = tiny_model(arch)
    adapter = Adapter.from_target(target, [1] if arch == "llama" else [1, 2]).eval()
    lengths = [12, 0, 7, 19]  # one context holds no position yet (a linear stage then starts from zeros)
    actxs = []
    for g, n in enumerate(lengths):
        states = true_states(target, sequence(g)[:n], adapter.target_indices) if n else None
        actx = adapter.new_context()
        actxs.append(adapter.extend_context(actx, states, 0) if n else actx)
    tokens = torch.randint(0, VOCAB, (len(lengths), 6), generator=torch.Generator().manual_seed(5))
    together = adapter.predict_many(actxs, tokens)  # [G, 6, n_idx*H]
    for g, actx in enumerate(actxs):
        torch.testing.assert_close(together[g], adapter.predict(actx, tokens[g:g + 1])[0], atol=ATOL, rtol=0)
    if arch == "llama":  # rows may start before a context's end (attention only)
        starts = [5, 0, 7, 11]
        together = adapter.predict_many(actxs, tokens, starts)
        for g, (actx, s) in enumerate(zip(actxs, starts)):
            torch.testing.assert_close(together[g], adapter.predict(actx, tokens[g:g + 1], s)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_scores_requests_of_different_lengths_in_one_pass(arch):
    """Rows of different context lengths, new context states and block lengths (and, on the hybrid, a row
    without a snapshot, which takes two passes): each row's logits and states, and each cache after the
    pass, equal what the one-request call gives."""
    model = tiny_model(arch)
    dec = ForesightDecoder(model, 2)
    keep = (dec.input_index + 1,)
    past, new, width = [0, 13, 5, 9], [8, 0, 4, 3], [5, 3, 4, 5]  # a fresh cache takes its prompt in the pass
    hybrid = bool(dec.linear_layers)
    alone, together, blocks, news, snaps = [], [], [], [], []
    for g, (t, m, w) in enumerate(zip(past, new, width)):
        ids = sequence(10 + g, 24)
        states, _ = true_run(model, ids, dec.input_index)
        cuts = [c for c in (t, t + m) if c]
        snap = snapshots(model, dec, ids, sorted(set(cuts))) if hybrid else {}
        for caches in (alone, together):
            cache = dec.new_cache()
            if t:
                dec.extend_context(cache, states[:t], 0, snap.get(t))
            caches.append(cache)
        blocks.append(states[t + m:t + m + w])
        news.append(states[t:t + m] if m else None)
        snaps.append(None if g == 3 else snap.get(t + m))  # row 3: no snapshot (two passes on the hybrid)
    padded = torch.zeros(len(past), max(width), blocks[0].shape[-1])
    for g, b in enumerate(blocks):
        padded[g, :len(b)] = b
    logits, states = dec.logits_and_hidden_many(together, padded, keep=keep, context_states=news, linear_states=snaps)
    for g, cache in enumerate(alone):
        want_logits, want_states = dec.logits_and_hidden(cache, blocks[g], keep=keep, context_states=news[g],
                                                         linear_states=snaps[g])
        torch.testing.assert_close(logits[g, :width[g]], want_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(states[g, :width[g]], want_states, atol=ATOL, rtol=0)
        assert together[g].length == cache.length == past[g] + new[g]
        assert together[g].adopted == cache.adopted and together[g].kv.layers[dec.layer_ids[-1]].keys.shape[0] == 1
        for i in dec.attention_layers:
            torch.testing.assert_close(together[g].kv.layers[i].keys, cache.kv.layers[i].keys, atol=ATOL, rtol=0)
        nxt = torch.randn(3, blocks[0].shape[-1], generator=torch.Generator().manual_seed(g))
        torch.testing.assert_close(dec.logits(together[g], nxt), dec.logits(cache, nxt), atol=ATOL, rtol=0)


def contexts(target, drafter: ForesightDrafter, prompts: list[list[int]]) -> list[DraftContext]:
    ctxs = []
    for g, prompt in enumerate(prompts):
        ctx = DraftContext(req_id=f"r{g}", tokens=list(prompt), seed=g, temperature=0.0,
                           hidden=[true_states(target, prompt[:-1], drafter.layout.layers)],
                           linear_states=linear_states(target, drafter, prompt, len(prompt) - 1))
        drafter.add_request(ctx)
        ctxs.append(ctx)
    return ctxs


def linear_states(target, drafter: ForesightDrafter, tokens: list[int], n: int):
    """The target's snapshot of the decoder's linear layers after positions 0..n-1 (None: no such layers)."""
    return snapshots(target, drafter.scorer.decoder, tokens, [n])[n] if drafter.layout.state_layers else None


@pytest.mark.parametrize("arch", ARCHS)
def test_foresee_batch_gives_each_request_what_foresee_gives_alone(arch):
    target = tiny_model(arch)
    alone, together = build(target), build(target)
    seqs = [sequence(20 + g) for g in range(3)]
    prompt_len, gamma, max_drafts = [9, 16, 5], [5, 3, 4], [6, 4, 5]  # every request its own lengths
    ctx_a = contexts(target, alone, [s[:p] for s, p in zip(seqs, prompt_len)])
    ctx_b = contexts(target, together, [s[:p] for s, p in zip(seqs, prompt_len)])
    for _ in range(2):  # the second round starts from the first's outcome: new states, a new snapshot
        blocks = [seq[len(c.tokens):len(c.tokens) + k] for seq, c, k in zip(seqs, ctx_a, gamma)]
        want = [alone.foresee(c, b, m, 0.0) for c, b, m in zip(ctx_a, blocks, max_drafts)]
        got = together.foresee_batch(ctx_b, blocks, max_drafts, 0.0)
        assert together.stats.requests == 3 and together.stats.outcomes == 9
        for w, g in zip(want, got):
            assert len(w) == 3 and [(e.accepted, e.bonus, e.tokens) for e in g] == [
                (e.accepted, e.bonus, e.tokens) for e in w]
            assert [(e.passes, e.refreshes) for e in g] == [(e.passes, e.refreshes) for e in w]
            assert [e.score for e in g] == pytest.approx([e.score for e in w], abs=ATOL)
        for seq, block, ca, cb in zip(seqs, blocks, ctx_a, ctx_b):  # the target accepts 2 drafts (the truth)
            n = len(ca.tokens) - 1
            truth = true_states(target, seq[:n + 3], together.layout.layers)
            for ctx in (ca, cb):
                ctx.last_block = Draft(block)
                ctx.absorb(2, seq[n + 3], truth[n:n + 3], linear_states(target, together, seq, n + 3))


class CountingForesight(ForesightDrafter):
    """Records the size of every `foresee_batch` call (`foresee` is a batch of one)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches: list[int] = []

    def foresee_batch(self, ctxs, *args, **kw):
        self.batches.append(len(ctxs))
        return super().foresee_batch(ctxs, *args, **kw)


def counting(target) -> CountingForesight:
    built = build(target)
    return CountingForesight(built.model, built.scorer, passes=1, cache_size=3, use_budget=False)


def test_pipelined_requests_at_once_are_lossless_and_foreseen_in_batches():
    target = tiny_model("llama")
    drafter = counting(target)
    prompts = [sequence(30 + g, n) for g, n in enumerate([9, 14, 6])]
    engine = InProcessEngine(target, EngineConfig(drafter="ngram", block_size=6), proposer=drafter,
                             foresight_to_completion=True)
    try:
        got = engine.generate_all(prompts, 30, mode="pipelined", temperature=0.0)
    finally:
        engine.close()
    for result, prompt in zip(got, prompts):
        assert result["error"] is None
        assert result["tokens"] == plain_greedy(target, prompt, 30, eos=target.config.eos_token_id)
    assert max(drafter.batches) >= 2, drafter.batches


def test_a_request_whose_part_fails_fails_alone():
    """The batch fails in its decoder pass because of one request; the worker runs the requests one by one,
    the others get the entries they get alone (their pending context states were given back)."""
    target = tiny_model("llama")
    drafter, fresh = counting(target), counting(target)
    prompts = [sequence(40 + g, n) for g, n in enumerate([9, 14, 6])]
    passes = drafter.scorer.decoder.logits_and_hidden_many

    def failing(caches, *args, **kw):
        if any(c is drafter.state(worker.contexts["r1"]).decoder for c in caches):
            raise RuntimeError("r1's part fails")
        return passes(caches, *args, **kw)

    drafter.scorer.decoder.logits_and_hidden_many = failing
    zctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        from_drafter = MessageSocket(zctx, zmq.PULL, addrs.drafter_to_target, bind=True)
        worker = DrafterWorker(EngineConfig(drafter="ngram", verify_length="max"), addrs, drafter, zctx)
        for i, prompt in enumerate(prompts):
            worker.on_start(StartDraft(req_id=f"r{i}", prompt_ids=prompt, seed=i,
                                       hidden=true_states(target, prompt, drafter.layout.layers)))
        worker.handle([Outcome(req_id=f"r{i}", round=1, accepted=0, bonus=7, max_drafts=5, strategy="pipelined")
                       for i in range(3)])
        blocks = [from_drafter.recv(timeout_ms=5000) for _ in range(3)]
        filled = {}
        for req_id, ctx in worker.contexts.items():
            ctx.foreseen = RecordedFill(req_id, filled)
        assert len(worker.jobs) == 3
        worker.run_jobs()
    finally:
        zctx.destroy(linger=0)
        addrs.remove()
    assert drafter.batches[-4:] == [3, 1, 1, 1] and not worker.jobs  # the batch, then each request alone
    assert sorted(filled) == ["r0", "r2"]
    blocks = {b.req_id: b.tokens for b in blocks}
    for req_id in ("r0", "r2"):
        prompt = prompts[int(req_id[1])]
        ctx = DraftContext(req_id=req_id, tokens=prompt + [7], seed=int(req_id[1]), pipelined=True,
                           hidden=[true_states(target, prompt, fresh.layout.layers)])
        fresh.add_request(ctx)
        assert fresh.propose(ctx, 5).tokens == blocks[req_id]  # the fallback draft (it draws noise too)
        want = fresh.foresee(ctx, blocks[req_id], 5, 0.0)
        round_, entries = filled[req_id]
        assert round_ == 2 and entries and [(e.accepted, e.bonus, e.tokens) for e in entries] == [
            (e.accepted, e.bonus, e.tokens) for e in want]
