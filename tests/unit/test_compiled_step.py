"""Compiled steps (models/compiled_step.py, models/slot_kv.py) against the eager forwards they replace, on
tiny Llama and Qwen3 models in fp32: logits and states of every block length with rollbacks of every length,
batched steps in between (plain steps and verify blocks of several requests, compiled; wider or padded too far,
eager), prompt chunks from an empty cache, greedy decoding in every mode, shapes beyond the graphs, the package cache
and a failing compiler. Compiling costs ~10 s a graph here, so one build per model (buckets 1 and 4, prompt chunks of
9-16 tokens, plain steps of 2-3 requests, blocks of 1-4 tokens of 2-64 requests) serves every test; targets with
sliding-window or linear-attention layers are refused (test_what_compile_choices_mean)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.models.compiled_step import (MAX_BATCH, MAX_PADDING, CompiledStep, GraphShape, batch_ranges,
                                            compiled_step_for, step_buckets, wants_compile)
from foresight.protocol.messages import HiddenLayout
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner
from foresight.models.slot_kv import SlotLayer
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

LAYERS = (1, 3)
BATCHES = ((2, 3),)  # the batched graph's range of requests
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]
CHUNK = (9, 16)  # the prompt-chunk graph's tokens of one request (5-8 fold their attention heads: eager)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return tiny_model(request.param, varied=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def compiled(model, cache_dir):
    """Graphs split for two threads (a target that borrows the drafter's core), run at one unless a test says."""
    step = CompiledStep(model, LAYERS, (1, 4), cache_dir, autotune=False, attention=packed_attention, threads=2,
                        batch_ranges=BATCHES, block_tokens=4, chunk_tokens=CHUNK)
    step.build()
    return step


def layout(model) -> HiddenLayout:
    return HiddenLayout(LAYERS, model.config.hidden_size)


def prefilled(model, compiled, prompts):
    """An eager and a compiled runner, each with a cache per prompt, prefilled -> (eager, fast, plain caches,
    compiled caches, the tokens each cache holds)."""
    eager, fast = TargetRunner(model, layout(model)), TargetRunner(model, layout(model), compiled=compiled)
    plain = [eager.new_cache() for _ in prompts]
    slots = [fast.new_cache() for _ in prompts]
    for prompt, a, b in zip(prompts, plain, slots):
        eager.prefill(a, prompt)
        fast.prefill(b, prompt)
    return eager, fast, plain, slots, [list(p) for p in prompts]


def assert_hold_as_a_full_forward(model, fast, slots, kept):
    """Each compiled cache holds exactly its kept tokens: the next step's logits are a full forward's over them."""
    for cache, tokens in zip(slots, kept):
        assert cache.get_seq_length() == len(tokens)
        with torch.inference_mode():
            full = model(torch.tensor([tokens + [3]])).logits[0, -1]
        torch.testing.assert_close(fast.verify(cache, 3, []).logits[0], full, atol=1e-4, rtol=1e-4)


def check_and_roll_back(runners, caches, rows, blocks, want, got, kept, gen) -> set[int]:
    """Compiled results equal eager ones; each row then rolls back a random number of its positions in both runners'
    caches (`kept`: the tokens each holds) -> the numbers of positions rolled back."""
    (eager, fast), (plain, slots) = runners, caches
    rolled = set()
    for r, block, w, g in zip(rows, blocks, want, got):
        torch.testing.assert_close(g.logits, w.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g.hidden, w.hidden, atol=1e-5, rtol=1e-5)
        rejected = int(torch.randint(0, len(block), (1,), generator=gen))
        rolled.add(rejected)
        eager.rollback(plain[r], rejected, w)
        fast.rollback(slots[r], rejected, g)
        kept[r] += block[:len(block) - rejected]
        assert slots[r].get_seq_length() == plain[r].get_seq_length() == len(kept[r])
    return rolled


def test_compiled_forwards_equal_eager_ones_through_rollbacks_and_batched_steps(model, compiled):
    """Blocks of 1..4 tokens (2 and 3 padded to the 4-token graph), each rolled back by a random number of
    positions, two requests, a batched step of their blocks every few rounds: logits, states and the caches stay the
    eager forwards', and end as a full forward over the kept tokens."""
    eager, fast, plain, slots, kept = prefilled(model, compiled, [PROMPT, PROMPT[3:] + [17, 18]])
    assert all(isinstance(layer, SlotLayer) for layer in slots[0].layers)
    gen = torch.Generator().manual_seed(0)
    rejected_counts, padded_too_far = set(), 0
    for step in range(24):
        blocks = [torch.randint(1, 90, (1 + (step + row) % 4,), generator=gen).tolist() for row in range(2)]
        if step % 5 == 4:
            lengths = [len(block) for block in blocks]
            padded_too_far += 2 * max(lengths) > MAX_PADDING * sum(lengths)  # those run eager
            want = eager.verify_batch(plain, blocks)
            got = fast.verify_batch(slots, blocks)
        else:
            want = [eager.verify(c, blk[0], blk[1:]) for c, blk in zip(plain, blocks)]
            got = [fast.verify(c, blk[0], blk[1:]) for c, blk in zip(slots, blocks)]
        rejected_counts |= check_and_roll_back((eager, fast), (plain, slots), range(2), blocks, want, got, kept, gen)
    assert rejected_counts == {0, 1, 2, 3} and fast.eager_forwards == 0 and fast.eager_batches == padded_too_far
    assert_hold_as_a_full_forward(model, fast, slots, kept)


def test_plain_steps_of_several_requests_run_the_batched_graph(model, compiled):
    """One token per request for two or three requests (the batch laid out anew when it changes, reused while it
    stays), single-request steps with rollbacks in between (each request's layers move back to buffers of their
    own): logits, states and caches stay the eager forwards', and end as a full forward over the kept tokens."""
    eager, fast, plain, slots, kept = prefilled(model, compiled, [PROMPT, PROMPT[3:] + [17, 18], PROMPT[:9]])
    gen = torch.Generator().manual_seed(1)
    reused = []
    for step in range(14):
        if step % 5 == 4:  # one request alone: a 3-token block, its last two drafts rejected
            row = step % 3
            block = torch.randint(1, 90, (3,), generator=gen).tolist()
            want, got = eager.verify(plain[row], block[0], block[1:]), fast.verify(slots[row], block[0], block[1:])
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
            eager.rollback(plain[row], 2, want)
            fast.rollback(slots[row], 2, got)
            kept[row].append(block[0])
            continue
        rows = [0, 1, 2] if step % 3 else [0, 2]
        blocks = [torch.randint(1, 90, (1,), generator=gen).tolist() for _ in rows]
        want = eager.verify_batch([plain[r] for r in rows], blocks)
        got = fast.verify_batch([slots[r] for r in rows], blocks)
        reused.append(fast.last_batch.reused)
        for r, block, w, g in zip(rows, blocks, want, got):
            torch.testing.assert_close(g.logits, w.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g.hidden, w.hidden, atol=1e-5, rtol=1e-5)
            kept[r] += block
    assert fast.eager_batches == 0 and fast.eager_forwards == 0
    assert any(reused) and not all(reused)
    assert_hold_as_a_full_forward(model, fast, slots, kept)


def test_verify_blocks_of_several_requests_run_the_blocks_graph(model, compiled, monkeypatch):
    """Blocks of 1-4 tokens of two or three requests in one step (rows padded to the widest however far, the batch
    laid out anew when it changes), each rolled back by a random number of positions, with single-request steps in
    between: logits, states and caches stay the eager packed forwards', and end as a full forward over the kept
    tokens."""
    monkeypatch.setattr(compiled, "max_padding", float("inf"))
    eager, fast, plain, slots, kept = prefilled(model, compiled, [PROMPT, PROMPT[3:] + [17, 18], PROMPT[:9]])
    gen = torch.Generator().manual_seed(2)
    rejected_counts, widths = set(), set()
    for step in range(16):
        rows = [0, 1, 2] if step % 3 else [step % 3, 2]
        widest = 2 + step % 3  # the first row's block; the others' of 1..widest tokens
        lengths = [widest] + torch.randint(1, widest + 1, (len(rows) - 1,), generator=gen).tolist()
        blocks = [torch.randint(1, 90, (n,), generator=gen).tolist() for n in lengths]
        if step % 4 == 3:  # one request alone between batched steps
            rows, blocks = rows[:1], blocks[:1]
            want = [eager.verify(plain[rows[0]], blocks[0][0], blocks[0][1:])]
            got = [fast.verify(slots[rows[0]], blocks[0][0], blocks[0][1:])]
        else:
            want = eager.verify_batch([plain[r] for r in rows], blocks)
            got = fast.verify_batch([slots[r] for r in rows], blocks)
            widths.add(max(len(block) for block in blocks))
        rejected_counts |= check_and_roll_back((eager, fast), (plain, slots), rows, blocks, want, got, kept, gen)
    assert widths >= {2, 3, 4} and rejected_counts == {0, 1, 2, 3}
    assert fast.eager_batches == 0 and fast.eager_forwards == 0
    assert_hold_as_a_full_forward(model, fast, slots, kept)


def test_batches_no_batched_graph_takes_run_eager_and_are_counted(model, compiled):
    """Blocks longer than the blocks' graph takes run the eager packed forward; plain steps of more requests than
    the 1-token graph's range run the blocks' graph."""
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    plain = [eager.new_cache() for _ in range(4)]
    slots = [fast.new_cache() for _ in range(4)]
    for i, (a, b) in enumerate(zip(plain, slots)):
        eager.prefill(a, PROMPT[i:])
        fast.prefill(b, PROMPT[i:])
    for blocks in ([[3], [4], [5], [6]], [[3, 4, 5, 6, 7], [5]], [[3, 4], [5, 6]]):
        want = eager.verify_batch(plain[:len(blocks)], blocks)
        got = fast.verify_batch(slots[:len(blocks)], blocks)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.logits, w.logits, atol=1e-5, rtol=1e-5)
            assert g.compiled == (blocks[0] != [3, 4, 5, 6, 7]) and not w.compiled
    assert fast.eager_batches == 1
    blocks = GraphShape(1, (2, MAX_BATCH), 4)
    assert compiled.batch_graph(3) == (GraphShape(1, (2, 3)), 1) and compiled.batch_graph(4) == (blocks, 1)
    assert compiled.batch_graph(4, 3) == (blocks, 3) and compiled.batch_graph(2, 5) is None


def test_blocks_are_padded_past_the_quantized_kernels_rows(model, compiled):
    """A quantized target's blocks' graph multiplies by the dense copies: rows x width is padded past the kernel's
    row limit (where an eager forward takes the dense copy too); a dense target's rows are not padded."""
    assert [compiled.block_width(rows, 2) for rows in (2, 3, 5, 9)] == [2, 2, 2, 2]
    quantized = CompiledStep(model, (), (1,), Path("unused"), autotune=False, block_tokens=8)
    quantized.kernel_limit = 8  # as an int4 target's
    assert [quantized.block_width(rows, 2) for rows in (2, 3, 4, 5, 9)] == [5, 3, 3, 2, 2]
    assert quantized.block_width(2, 7) == 7


def test_blocks_padded_past_the_limit_run_the_eager_packed_forward(model, compiled):
    """Rows padded to the widest block cost the graph what they would cost real tokens: a batch whose padding makes
    more than MAX_PADDING computed rows per real token runs eager (it computes only the real tokens)."""
    blocks = GraphShape(1, (2, MAX_BATCH), 4)
    assert compiled.batch_graph(3, 4, fed=3 * 4) == (blocks, 4)
    assert compiled.batch_graph(3, 4, fed=10) == (blocks, 4)  # 12 rows for 10 tokens
    assert compiled.batch_graph(3, 4, fed=6) is None  # 12 rows for 6 tokens
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    plain, slots = [eager.new_cache() for _ in range(3)], [fast.new_cache() for _ in range(3)]
    for i, (a, b) in enumerate(zip(plain, slots)):
        eager.prefill(a, PROMPT[i:])
        fast.prefill(b, PROMPT[i:])
    for blocks in ([[3, 4, 5, 6], [7], [8]], [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12]]):
        want, got = eager.verify_batch(plain, blocks), fast.verify_batch(slots, blocks)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.logits, w.logits, atol=1e-5, rtol=1e-5)
            assert g.compiled == (blocks[1] != [7]) and not w.compiled  # the first batch padded too far
    assert fast.eager_batches == 1


def test_batched_and_chunk_graphs_that_fail_to_compile_leave_those_forwards_eager(model, tmp_path, monkeypatch,
                                                                                   caplog):
    real = CompiledStep.compile

    def fails_batched(self, shape, path):
        if shape.rows != (1, 1) or shape.blocks:
            raise RuntimeError(f"injected compile failure of {shape.name}")
        return real(self, shape, path)

    monkeypatch.setattr(CompiledStep, "compile", fails_batched)
    step = CompiledStep(model, (), (1,), tmp_path, autotune=False, attention=packed_attention, batch_ranges=BATCHES,
                        block_tokens=2, chunk_tokens=(9, 12))
    with caplog.at_level(logging.WARNING, logger="foresight.compiled_step"):
        step.build()
    assert list(step.graphs) == [GraphShape(1)] and step.batch_graph(2) is None and step.batch_graph(2, 2) is None
    assert step.single_graph(9) is None and TargetRunner(model, compiled=step).shares_chunks
    assert "injected compile failure of 9-12" in caplog.text and "injected compile failure of 1-2x2-64" in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_graphs_split_for_two_threads_run_on_one_or_two(model, compiled, threads):
    """A step that borrows the drafter's thread and one that does not run the same graphs (dynamic threads)."""
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    a, b = eager.new_cache(), fast.new_cache()
    eager.prefill(a, PROMPT)
    fast.prefill(b, PROMPT)
    torch.set_num_threads(threads)
    try:
        for block in ([3], [4, 5, 6, 7], [8, 9]):
            torch.testing.assert_close(fast.verify(b, block[0], block[1:]).logits,
                                       eager.verify(a, block[0], block[1:]).logits, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(1)
    assert fast.eager_forwards == 0


def test_prompt_chunks_run_the_chunk_graph_from_an_empty_cache(model, compiled):
    """A prompt fed in chunks of 9 to 16 tokens, the first into empty buffers, every position's logits kept (as for
    prompt logprobs), and chunks the buckets take: logits, states and the cache equal the eager forwards', and
    decoding goes on compiled; a chunk between the largest bucket and the chunk graph runs eager and is counted."""
    eager, fast = TargetRunner(model, layout(model)), TargetRunner(model, layout(model), compiled=compiled)
    a, b = eager.new_cache(), fast.new_cache()
    prompt = (PROMPT * 4)[:46]
    for start, end in ((0, 16), (16, 25), (25, 37), (37, 40), (40, 46)):  # 3 tokens: a bucket; 6: eager
        chunk = prompt[start:end]
        want, got = eager.prefill(a, chunk, keep_logits=len(chunk)), fast.prefill(b, chunk, keep_logits=len(chunk))
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
        assert got.compiled == (len(chunk) != 6) and b.get_seq_length() == end
    assert all(isinstance(layer, SlotLayer) for layer in b.layers) and fast.eager_forwards == 1
    assert compiled.single_graph(16) == (GraphShape(9, (1, 1), 16), 16) and compiled.single_graph(3)[1] == 4
    assert compiled.single_graph(6) is None and fast.compile_info()["chunk_tokens"] == list(CHUNK)
    assert_hold_as_a_full_forward(model, fast, [b], [prompt])
    assert not fast.shares_chunks and eager.shares_chunks  # a chunk runs apart from other requests' rounds


def test_a_prompt_chunked_beside_another_requests_rounds_runs_its_own_graph(model, compiled):
    """A second prompt arrives while the first request decodes: its chunks run the chunk graph in a forward of their
    own, the first request's rounds their bucket's (no eager forward of both), and both outputs stay plain greedy."""
    second = (PROMPT * 4)[:49]  # chunks of 15 tokens (the step's 16 less the other request's 1), then 4: a bucket
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4, max_num_batched_tokens=16),
                             compiled=compiled)
    try:
        got = engine.generate_all([PROMPT, second], 30, mode="ar", temperature=0.0)
        runner = engine.target.runner
    finally:
        engine.close()
    for prompt, result in zip([PROMPT, second], got):
        assert result["error"] is None
        assert result["tokens"] == plain_greedy(model, prompt, 30, eos=model.config.eos_token_id)
    assert runner.eager_batches == 0 and runner.eager_forwards == 0


def test_a_forward_longer_than_the_chunk_graph_runs_eager_and_is_counted(model, compiled):
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    a, b = eager.new_cache(), fast.new_cache()
    eager.prefill(a, PROMPT)
    fast.prefill(b, PROMPT)
    block = [3 + i for i in range(CHUNK[1] + 2)]
    longer = fast.verify(b, block[0], block[1:])
    torch.testing.assert_close(longer.logits, eager.verify(a, block[0], block[1:]).logits, atol=1e-5, rtol=1e-5)
    assert fast.eager_forwards == 1 and not longer.compiled and compiled.single_graph(CHUNK[1] + 1) is None
    step = fast.verify(b, 9, [])
    torch.testing.assert_close(step.logits, eager.verify(a, 9, []).logits, atol=1e-5, rtol=1e-5)
    assert fast.eager_forwards == 1 and step.compiled  # and the cache goes on compiled


@pytest.mark.parametrize("mode", ["ar", "sync", "pipelined"])
def test_greedy_decoding_on_compiled_steps_equals_plain_greedy(model, compiled, mode):
    proposer = OracleForesight(model, cuts=2)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4), proposer=proposer,
                             foresight_to_completion=True, compiled=compiled)
    try:
        got = engine.generate(PROMPT, 40, mode=mode, temperature=0.0)
        runner = engine.target.runner
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == plain_greedy(model, PROMPT, 40, eos=model.config.eos_token_id)
    assert runner.eager_forwards == 0 and all(r.compiled is True for r in got["rounds"])  # what /metrics counts
    if mode != "ar":
        drafted = [r for r in got["rounds"] if r.drafted]
        assert any(0 < r.accepted < r.drafted for r in drafted) and any(r.accepted == r.drafted for r in drafted)


def test_a_second_build_loads_the_packages(model, compiled, cache_dir):
    again = CompiledStep(model, LAYERS, (1, 4), cache_dir, autotune=False, attention=packed_attention, threads=2)
    again.build()
    assert again.loaded == 2 and again.compile_s == 0.0
    other = tiny_model(model.config.model_type, seed=1, varied=True)  # other weights: another key
    assert CompiledStep(other, LAYERS, (1, 4), cache_dir, autotune=False, threads=2).fingerprint() \
        != again.fingerprint()
    serial = CompiledStep(model, LAYERS, (1, 4), cache_dir, autotune=False, threads=1)  # split for one thread
    assert serial.fingerprint() != again.fingerprint()


def test_a_failing_compiler_leaves_the_steps_eager(model, tmp_path, monkeypatch, caplog):
    def broken(self, bucket, path):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr(CompiledStep, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="foresight.compiled_step"):
        step = compiled_step_for(model, "on", "cpu", (), 4, tmp_path, packed_attention)
    assert step is None
    assert "injected compiler failure" in caplog.text and "eagerly" in caplog.text


def test_what_compile_choices_mean(model):
    assert step_buckets(8) == (1, 2, 4, 8) and step_buckets(6) == (1, 2, 4, 6) and step_buckets(2) == (1, 2)
    assert batch_ranges(model) == ()  # dense linears: the blocks' graph takes plain steps of several requests
    assert not wants_compile("off", model, "cpu")
    assert wants_compile("on", model, "cpu")
    assert not wants_compile("auto", model, "cpu")  # dense: not measured faster
    assert not wants_compile("auto", tiny_model("gemma3"), "cpu")
    with pytest.raises(ConfigError, match="compile"):
        wants_compile("on", tiny_model("qwen3_5"), "cpu")  # linear-attention layers
    with pytest.raises(ConfigError, match="compile"):
        wants_compile("on", model, "cuda")
    with pytest.raises(ConfigError, match="compile"):
        EngineConfig(compile="sometimes")


def test_packages_no_start_used_for_two_weeks_are_pruned(tmp_path):
    """Every new key (model, traced code, threads, torch) leaves the old packages behind: a start deletes those
    unused for STALE_DAYS, and partial ones an hour old; what a start loads is touched, so it stays."""
    import os
    import time

    from foresight.models.compiled_step import STALE_DAYS, prune_stale

    now = time.time()
    ages = {"step-old-1.pt2": STALE_DAYS * 86400 + 60, "step-recent-1.pt2": 3600,
            "step-x-1.123.partial.pt2": 7200, "step-y-1.124.partial.pt2": 60, "notes.txt": 10**8}
    for name, age in ages.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (now - age, now - age))
    gone = prune_stale(tmp_path, now=now)
    assert sorted(p.name for p in gone) == ["step-old-1.pt2", "step-x-1.123.partial.pt2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-recent-1.pt2", "step-y-1.124.partial.pt2"]
