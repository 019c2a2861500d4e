"""Many requests in one target step: one forward over every ready request's block, prompts prefilled in
chunks between them. Served together, requests must give what they give alone (fp32)."""
from __future__ import annotations

import time

import pytest
import torch

from foresight.config import EngineConfig
from foresight.protocol.messages import AbortRequest, GenerateRequest, HiddenLayout, SamplingParams, TokenOutput
from foresight.target_worker.batched_kv import SPARE_COLUMNS
from foresight.target_worker.runner import TargetRunner
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

# Repeated n-grams: prompt lookup lands some drafts and misses others, so accept lengths differ per row.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [11, 12, 13, 11, 12, 13, 11, 12, 13, 40, 11, 12, 13, 11, 12, 13, 40],
    [3, 17, 3, 17, 3, 17, 60, 61, 62, 3, 17, 3, 17, 60, 61],
    [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 21, 22, 23, 24, 25, 26],
]
CHUNK = 6  # max_num_batched_tokens: every prompt above is prefilled in several chunks


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def prefilled(runner: TargetRunner, prompt: list[int]):
    cache = runner.new_cache()
    if prompt:
        runner.prefill(cache, prompt)
    return cache


@pytest.mark.parametrize("arch,blocks", [
    ("llama", [[7, 8, 9], [4], [1, 2, 3, 4, 5], [9, 9]]),  # lengths differ: the attention pads rows
    ("qwen3", [[7, 8, 9], [4], [1, 2, 3, 4, 5], [9, 9]]),
    ("llama", [[7, 8], [4, 1], [1, 2], [9, 9]]),  # one length: the packed rows are the padded batch
])
def test_verify_batch_gives_what_each_verify_gives(arch, blocks):
    model = tiny_model(arch)
    runner = TargetRunner(model, HiddenLayout((1, 2), model.config.hidden_size))
    alone = []
    for prompt, block in zip(PROMPTS, blocks):
        cache = prefilled(runner, prompt)
        alone.append((cache, runner.verify(cache, block[0], block[1:])))
    caches = [prefilled(runner, p) for p in PROMPTS]
    results = runner.verify_batch(caches, blocks)
    for (cache_a, a), cache_b, b, block in zip(alone, caches, results, blocks):
        assert b.logits.shape == a.logits.shape == (len(block), model.config.vocab_size)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=1e-5)
        assert cache_b.get_seq_length() == cache_a.get_seq_length()
        for la, lb in zip(cache_a.layers, cache_b.layers):
            torch.testing.assert_close(lb.keys, la.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lb.values, la.values, atol=1e-5, rtol=1e-5)
    # The caches go on as usual: a crop, then a one-request verify.
    for (cache_a, a), cache_b, b in zip(alone, caches, results):
        runner.rollback(cache_a, 1, a)
        runner.rollback(cache_b, 1, b)
        torch.testing.assert_close(runner.verify(cache_b, 3, [4]).logits, runner.verify(cache_a, 3, [4]).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fed", [0, 9])  # a prompt's first chunk, and one that continues it
def test_a_prompt_chunk_in_the_forward_gives_what_it_gives_alone(llama, fed):
    """A prompt chunk packed with verify blocks: the chunk's last logits, its states and its cache are what a
    prefill of its own gives, and the blocks' results what their verifies alone give."""
    runner = TargetRunner(llama, HiddenLayout((1, 2), llama.config.hidden_size))
    prompt, blocks = PROMPTS[3], [[7, 8, 9], [4], [1, 2, 3, 4, 5]]
    chunk_alone, chunk_together = prefilled(runner, prompt[:fed]), prefilled(runner, prompt[:fed])
    want_chunk = runner.prefill(chunk_alone, prompt[fed:])
    want = []
    for p, block in zip(PROMPTS, blocks):
        cache = prefilled(runner, p)
        want.append(runner.verify(cache, block[0], block[1:]))
    caches = [prefilled(runner, p) for p in PROMPTS[:3]]
    *got, got_chunk = runner.verify_batch(caches, blocks, (chunk_together, prompt[fed:]))
    assert len(got) == len(blocks)
    for a, b in zip(want, got):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=1e-5)
    assert got_chunk.logits.shape == want_chunk.logits.shape == (1, llama.config.vocab_size)
    torch.testing.assert_close(got_chunk.logits, want_chunk.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_chunk.hidden, want_chunk.hidden, atol=1e-5, rtol=1e-5)
    assert chunk_together.get_seq_length() == len(prompt)
    for la, lb in zip(chunk_alone.layers, chunk_together.layers):
        torch.testing.assert_close(lb.keys, la.keys, atol=1e-5, rtol=1e-5)
    # The model attends as before once the packed forward is over, and the chunk's cache goes on as usual.
    torch.testing.assert_close(runner.verify(chunk_together, 3, [4]).logits,
                               runner.verify(chunk_alone, 3, [4]).logits, atol=1e-5, rtol=1e-5)
    assert llama.config._attn_implementation == "sdpa"


def test_consecutive_batched_steps_reuse_the_layout_and_stay_exact():
    """Steady state writes only new positions into the last step's tensors; rollbacks of every length, a row
    that leaves and rows that outgrow the spare room must all keep every request's cache exact: each ends
    as a full forward over the tokens it kept (on a model whose logits follow the context)."""
    model = tiny_model("llama", varied=True)
    runner = TargetRunner(model)
    alone = [prefilled(runner, p) for p in PROMPTS]
    together = [prefilled(runner, p) for p in PROMPTS]
    kept = [list(p) for p in PROMPTS]
    gen = torch.Generator().manual_seed(0)
    reused = 0
    for step in range(40):
        rows = range(len(PROMPTS)) if step < 20 else range(1, len(PROMPTS))  # a row leaves at step 20
        blocks = [torch.randint(1, 90, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in rows]
        results = runner.verify_batch([together[b] for b in rows], blocks)
        reused += runner.last_batch.reused
        for b, block, got in zip(rows, blocks, results):
            want = runner.verify(alone[b], block[0], block[1:])
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
            rejected = int(torch.randint(0, len(block), (1,), generator=gen))
            runner.rollback(alone[b], rejected, want)
            runner.rollback(together[b], rejected, got)
            kept[b] += block[:len(block) - rejected]
    assert reused >= 30, reused
    assert together[1].get_seq_length() > PROMPTS[1].__len__() + SPARE_COLUMNS  # the room was outgrown
    for cache, tokens in zip(together, kept):
        assert cache.get_seq_length() == len(tokens)
        with torch.inference_mode():
            full = model(torch.tensor([tokens + [3, 4]])).logits[0, -2:]
        torch.testing.assert_close(runner.verify(cache, 3, [4]).logits, full, atol=1e-4, rtol=1e-4)


def test_a_failed_batched_forward_leaves_every_cache_as_it_was(llama, monkeypatch):
    runner = TargetRunner(llama)
    caches = [prefilled(runner, p) for p in PROMPTS[:2]]
    before = [[(layer.keys, layer.values) for layer in c.layers] for c in caches]

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    fresh = runner.new_cache()  # a prompt's first chunk: its layers are not even initialised yet
    monkeypatch.setattr(llama.model.layers[1], "forward", broken)  # after layer 0 has written its KV
    with pytest.raises(RuntimeError, match="injected"):
        runner.verify_batch(caches, [[1, 2], [3]], (fresh, [4, 5, 6]))
    for cache, layers in zip(caches, before):
        assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, layers))
    assert fresh.get_seq_length() == 0 and not fresh.layers[0].is_initialized
    assert llama.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    torch.testing.assert_close(runner.prefill(fresh, [4, 5, 6]).logits,
                               runner.prefill(runner.new_cache(), [4, 5, 6]).logits)


def test_only_full_attention_targets_batch():
    assert TargetRunner(tiny_model("llama")).batches_requests
    assert not TargetRunner(tiny_model("gemma3")).batches_requests  # sliding-window layers
    assert not TargetRunner(tiny_model("qwen3_5")).batches_requests  # linear-attention layers


def spy_steps(engine: InProcessEngine) -> list[tuple[int, bool]]:
    """Record (blocks verified, a prompt chunk too?) of every batched forward of the target."""
    steps, verify_batch = [], engine.target.runner.verify_batch

    def recording(caches, blocks, chunk=None):
        steps.append((len(blocks), chunk is not None))
        return verify_batch(caches, blocks, chunk)

    engine.target.runner.verify_batch = recording
    return steps


@pytest.mark.parametrize("mode", ["ngram", "sync"])
def test_requests_served_together_equal_plain_greedy(llama, mode):
    engine = InProcessEngine(llama, EngineConfig(drafter="ngram", block_size=6, max_num_batched_tokens=CHUNK))
    try:
        steps = spy_steps(engine)
        ids = [engine.submit(p, 40, mode=mode, temperature=0.0) for p in PROMPTS]
        results = engine.collect(ids)
    finally:
        engine.close()
    for rid, prompt in zip(ids, PROMPTS):
        assert results[rid]["error"] is None
        assert results[rid]["tokens"] == plain_greedy(llama, prompt, 40, eos=llama.config.eos_token_id)
    if mode == "ngram":  # rounds the target drafts itself are always ready (sync rounds wait for blocks)
        assert any(rounds >= 2 for rounds, _ in steps), "no step verified two requests together"
        assert any(rounds >= 1 and chunk for rounds, chunk in steps), "no prompt chunk shared a forward with rounds"
    accepted = {r.accepted for rid in ids for r in results[rid]["rounds"] if r.drafted}
    assert len(accepted) >= 2, f"every block had the same accept length {accepted}: rows were never uneven"


def test_sampled_requests_keep_their_seeds_when_served_together(llama):
    engine = InProcessEngine(llama, EngineConfig(drafter="ngram", block_size=6, max_num_batched_tokens=CHUNK))
    try:
        sampling = dict(mode="ar", temperature=1.0, top_p=0.95)
        alone = [engine.generate(p, 30, seed=100 + i, **sampling)["tokens"] for i, p in enumerate(PROMPTS)]
        steps = spy_steps(engine)
        ids = [engine.submit(p, 30, seed=100 + i, **sampling) for i, p in enumerate(PROMPTS)]
        together = engine.collect(ids)
    finally:
        engine.close()
    assert [together[rid]["tokens"] for rid in ids] == alone
    assert any(rounds >= 2 for rounds, _ in steps)


def test_a_failed_batched_forward_fails_no_request(llama, monkeypatch):
    engine = InProcessEngine(llama, EngineConfig(drafter="ngram", block_size=6))
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        monkeypatch.setattr(engine.target.runner, "verify_batch", broken)
        results = engine.generate_all(PROMPTS, 20, mode="ngram", temperature=0.0)
    finally:
        engine.close()
    for result, prompt in zip(results, PROMPTS):
        assert result["error"] is None
        assert result["tokens"] == plain_greedy(llama, prompt, 20, eos=llama.config.eos_token_id)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])
def test_chunked_prefill_equals_plain_greedy(arch):
    """Chunks continue every kind of cache: full attention, sliding windows, linear-attention state."""
    model = tiny_model(arch)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4, max_num_batched_tokens=4))
    try:
        prompt = PROMPTS[0] + PROMPTS[3]  # 42 tokens: 11 chunks, past the sliding window of 8
        got = engine.generate(prompt, 24, mode="ngram", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == plain_greedy(model, prompt, 24, eos=model.config.eos_token_id)


def test_a_long_prompt_does_not_stop_other_streams(llama):
    engine = InProcessEngine(llama, EngineConfig(drafter="ngram", block_size=4, max_num_batched_tokens=8))
    try:
        running = "running"
        engine.send_to_target.send(GenerateRequest(req_id=running, prompt_ids=PROMPTS[0], max_tokens=200,
                                                   sampling=SamplingParams(temperature=0.0), ignore_eos=True,
                                                   mode="ar"))
        while not isinstance(msg := engine.recv_from_workers.recv(timeout_ms=30000), TokenOutput):
            assert msg is not None
        long_prompt = (PROMPTS[1] * 8)[:128]  # 16 chunks of 8
        late = engine.submit(long_prompt, 4, mode="ar", temperature=0.0)
        outputs_meanwhile = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = engine.recv_from_workers.recv(timeout_ms=30000)
            assert msg is not None
            if isinstance(msg, TokenOutput) and msg.req_id == late:
                break
            if isinstance(msg, TokenOutput) and msg.req_id == running:
                outputs_meanwhile += 1
        engine.send_to_target.send(AbortRequest(req_id=running))
    finally:
        engine.close()
    # One output of the running request per chunk of the long prompt (one prefill forward would allow one).
    assert outputs_meanwhile >= 12, outputs_meanwhile
