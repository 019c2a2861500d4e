"""A target split over two ranks by tensor parallelism (target_worker/tensor_parallel.py), on the CPU: this test
process is rank 0, a child process rank 1, over gloo. What the split runner computes equals what one runner over
the whole model computes, its caches follow every call (prefill, verify, rollback, batched verification, a copied
prefill), greedy serving through it equals plain greedy decoding, and a rank that dies stops the worker."""
from __future__ import annotations

import gc

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.protocol.messages import HiddenLayout
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.tensor_parallel import RankLost, split_target
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

LAYOUT = HiddenLayout(layers=(1, 3), hidden_size=32)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", varied=True)


@pytest.fixture
def split(model, tmp_path):
    """Rank 0 of a fresh group (one group at a time in a process)."""
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    cfg = EngineConfig(target=str(path), drafter="ngram", dtype="float32", tensor_parallel_size=2,
                       block_size=6)
    with split_target(cfg, path, LAYOUT) as runner:
        yield runner


def assert_same(got, want) -> None:
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)


def test_the_split_target_holds_half_the_kv_heads_and_computes_what_the_whole_one_does(model, split):
    whole = TargetRunner(model, LAYOUT)
    caches = {"split": split.new_cache(), "whole": whole.new_cache()}
    runners = {"split": split, "whole": whole}
    got = {k: r.prefill(caches[k], PROMPT, keep_logits=3) for k, r in runners.items()}
    assert_same(got["split"], got["whole"])
    assert caches["split"].layers[0].keys.shape[1] == model.config.num_key_value_heads // 2  # [1, kv/2, T, D]
    for rejected in (3, 0, 5):  # a partial, a full and a nothing-accepted round, then the next block
        got = {k: r.verify(caches[k], 17 + rejected, [23, 29, 31, 37, 41]) for k, r in runners.items()}
        assert_same(got["split"], got["whole"])
        for k, r in runners.items():
            r.rollback(caches[k], rejected, got[k])
        assert caches["split"].get_seq_length() == caches["whole"].get_seq_length()
    twins = {k: r.copy_cache(caches[k]) for k, r in runners.items()}  # a request taking another's prefill
    fresh = {k: r.new_cache() for k, r in runners.items()}
    got = {k: r.verify_batch([caches[k], twins[k]], [[3, 4, 5], [6]], (fresh[k], PROMPT[:7]))
           for k, r in runners.items()}
    for mine, theirs in zip(got["split"], got["whole"]):
        assert_same(mine, theirs)
    got = {k: r.verify(twins[k], 9, [10]) for k, r in runners.items()}  # the copy went on apart from its source
    assert_same(got["split"], got["whole"])


def test_caches_dropped_on_rank_0_are_freed_on_the_others_with_the_next_call(split):
    for _ in range(3):  # the caches freed after the first flush must reach the list the next one sends
        cache = split.new_cache()  # sends the frees pending
        assert split.freed == []
        split.prefill(cache, PROMPT)
        cache_id = split.cache_ids[cache]
        del cache
        gc.collect()
        assert split.freed == [cache_id]


def test_greedy_serving_on_the_split_target_equals_plain_greedy(model, split):
    """Rounds that accept none, some and all of their drafts (the oracle cuts its drafts at random)."""
    proposer = OracleForesight(model, cuts=1)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6), proposer=proposer,
                             foresight_to_completion=True, runner=split)
    try:
        results = engine.generate_all([PROMPT, PROMPT, PROMPT[:9]], 40, mode="sync", temperature=0.0)
    finally:
        engine.close()
    for prompt, got in zip([PROMPT, PROMPT, PROMPT[:9]], results):
        assert got["error"] is None
        assert got["tokens"] == plain_greedy(model, prompt, 40, eos=model.config.eos_token_id)
    drafted = [r for res in results for r in res["rounds"] if r.drafted]
    assert any(0 < r.accepted < r.drafted for r in drafted) and any(r.accepted == r.drafted for r in drafted)


def test_a_rank_that_died_stops_the_worker(model, tmp_path):
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    cfg = EngineConfig(target=str(path), drafter="ngram", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(RankLost, match=r"rank\(s\) \[1\] exited"):
        with split_target(cfg, path, HiddenLayout()) as runner:
            cache = runner.new_cache()
            runner.ranks[0].kill()
            runner.ranks[0].wait()
            runner.prefill(cache, PROMPT)


@pytest.mark.parametrize("flags, message", [
    ({"compile": "on"}, "compile 'on' does not apply to a tensor-parallel target"),
    ({"quantization": "int4"}, "quantization 'int4' does not apply"),
    ({"cpu_linear": "prepacked"}, "cpu_linear 'prepacked' does not apply"),
    ({"target_device": "cuda:0", "drafter_device": "cuda:1"}, "drafter_device cuda:1 is one of the"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
])
def test_split_target_settings_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{"tensor_parallel_size": 2, **flags})


def test_a_split_target_takes_target_device_and_the_next_ones():
    cfg = EngineConfig(tensor_parallel_size=2, target_device="cuda:1", drafter_device="cuda:0")
    assert cfg.target_devices() == ["cuda:1", "cuda:2"]
    assert EngineConfig(tensor_parallel_size=3).target_devices() == ["cpu"] * 3


def test_a_bf16_split_target_decides_on_fp32_logits_from_the_whole_head(model, tmp_path):
    """The fp32 logit head (logit_head.py) gathers the sharded LM head: its logits are the whole model's fp32
    head over the split body's states (bf16 bodies summed in another order differ by rounding only)."""
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    cfg = EngineConfig(target=str(path), drafter="ngram", dtype="bfloat16", tensor_parallel_size=2)
    whole = TargetRunner(tiny_model("llama", varied=True).to(torch.bfloat16), LAYOUT)
    with split_target(cfg, path, LAYOUT) as split:
        assert split.logit_precision == whole.logit_precision == "fp32-top"
        got, want = (r.prefill(r.new_cache(), PROMPT, keep_logits=4) for r in (split, whole))
    assert got.logits.dtype == torch.float32
    torch.testing.assert_close(got.logits, want.logits, atol=0.05, rtol=0.02)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


def test_a_split_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(model, tmp_path):
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)  # 4 heads, 2 KV heads
    cfg = EngineConfig(target=str(path), drafter="ngram", dtype="float32", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 must divide the target's 4 attention heads and 2 KV"):
        with split_target(cfg, path, HiddenLayout()):
            pass
