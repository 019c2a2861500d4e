"""8-bit weights per output channel on torch's int8 kernel (`--quantization int8`): served weights, both paths,
logits and every greedy mode against plain greedy decoding of the int8 target."""
from __future__ import annotations

import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.models.compiled_step import batch_ranges
from foresight.models.int8_linear import INT8_MAX_ROWS, Int8Linear
from foresight.models.quantization import quantize_model, resolve_quantization
from foresight.models.weight_only import kernel_rows
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)


def test_int8_weights_are_the_dense_ones_within_half_a_step_per_channel():
    weight = torch.randn(48, 64) * torch.linspace(0.01, 1.0, 48)[:, None]  # channels of very different range
    weight[3] = 0  # an all-zero channel must not divide by zero
    layer = Int8Linear(weight, None, torch.float32)
    assert layer.codes.dtype == torch.int8 and int(layer.codes.abs().max()) == 127
    step = layer.scale[:, None]  # [out, 1]
    assert ((layer.served_weight() - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(layer.served_weight()[3], torch.zeros(64))


@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 40])
def test_int8_linear_kernel_and_dense_copy_multiply_by_the_same_weights(rows):
    weight, bias = torch.randn(48, 64), torch.randn(48)
    layer = Int8Linear(weight, bias, torch.float32)
    x = torch.randn(2, rows, 64)
    want = x @ layer.served_weight().t() + bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_int8_linear_in_bf16_stays_close_to_the_dense_weights():
    weight = torch.randn(96, 128) * 0.05
    layer = Int8Linear(weight, None, torch.bfloat16)
    x = torch.randn(INT8_MAX_ROWS, 128)
    want = x @ weight.t()
    got = layer(x.bfloat16()).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_int8_is_chosen_only_when_asked_and_only_on_a_cpu():
    assert resolve_quantization("int8", None, torch.bfloat16, "cpu") == "int8"
    assert resolve_quantization("auto", None, torch.bfloat16, "cpu") == "none"
    with pytest.raises(ConfigError, match="quantization: int8"):
        resolve_quantization("int8", None, torch.bfloat16, "cuda:0")
    assert EngineConfig(quantization="int8").quantization == "int8"


def test_an_int8_target_splits_its_batched_graphs_at_the_kernels_row_limit():
    model = tiny_model("llama")
    assert kernel_rows(model) is None and batch_ranges(model) == ()
    assert quantize_model(model, "int8", None, "test") == 21
    assert kernel_rows(model) == INT8_MAX_ROWS
    assert batch_ranges(model) == ((2, INT8_MAX_ROWS),)  # more rows: the blocks' graph (its dense copies)


def test_every_greedy_mode_equals_plain_greedy_on_the_int8_target():
    """Lossless with respect to the target as served: the int8 model's plain greedy decoding (whole sequences:
    its dense copy) against every mode's (1- and 2-row steps: the kernel; blocks: the dense copy). Drafts are
    the target's own continuation with every third token wrong, so blocks are partly accepted and rolled back."""
    model = tiny_model("llama", seed=4)
    dense = tiny_model("llama", seed=4)
    assert quantize_model(model, "int8", None, "test") == 21
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        assert not torch.equal(model(ids).logits, dense(ids).logits)  # int8 weights are served, not the dense
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6),
                             proposer=OracleForesight(model, share=True))
    try:
        accepted = rejected = 0
        want = plain_greedy(model, prompt, 30, eos=model.config.eos_token_id)
        for mode in ("ar", "ngram", "sync", "pipelined", "auto"):
            got = engine.generate(prompt, 30, mode=mode, temperature=0.0)
            assert got["error"] is None and got["tokens"] == want, mode
            accepted += sum(r.accepted for r in got["rounds"])
            rejected += sum(r.drafted - r.accepted for r in got["rounds"])
    finally:
        engine.close()
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_compiled_steps_of_an_int8_target_equal_its_eager_steps(tmp_path):
    """The int8 kernel inside an AOTInductor graph (1- and 2-token steps: the kernel's rows) gives the eager
    forwards' logits, through a rollback, and a block past the buckets runs eager (the dense copy)."""
    from foresight.models.compiled_step import CompiledStep
    from foresight.target_worker.packed_step import packed_attention
    from foresight.target_worker.runner import TargetRunner

    model = tiny_model("llama", varied=True)
    quantize_model(model, "int8", None, "test")
    compiled = CompiledStep(model, (), (1, 2), tmp_path, autotune=False, attention=packed_attention)
    compiled.build()
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    plain, slots = eager.new_cache(), fast.new_cache()
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 40, 41]
    eager.prefill(plain, prompt)
    fast.prefill(slots, prompt)
    for block, rejected in (([3], 0), ([11, 12], 1), ([13, 14], 0), ([15, 16, 17], 2), ([18], 0)):
        want, got = eager.verify(plain, block[0], block[1:]), fast.verify(slots, block[0], block[1:])
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        eager.rollback(plain, rejected, want)
        fast.rollback(slots, rejected, got)
    assert fast.eager_forwards == 2  # the prompt and the 3-token block: no graph of their size


def test_the_blocks_graph_of_an_int8_target_multiplies_by_the_dense_copy(tmp_path):
    """The graph for verify blocks of several requests (rows x tokens symbolic) is traced with every linear on its
    dense copy, and fed more rows than the kernel takes, as the eager packed forward of those blocks is: the same
    logits."""
    from foresight.models.compiled_step import CompiledStep
    from foresight.target_worker.packed_step import packed_attention
    from foresight.target_worker.runner import TargetRunner

    model = tiny_model("llama", varied=True)
    quantize_model(model, "int8", None, "test")
    compiled = CompiledStep(model, (), (1,), tmp_path, autotune=False, attention=packed_attention, block_tokens=3)
    compiled.build()
    assert compiled.block_width(2, 2) * 2 > INT8_MAX_ROWS
    eager, fast = TargetRunner(model), TargetRunner(model, compiled=compiled)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [9, 40, 41, 42, 3]]
    plain, slots = [eager.new_cache() for _ in prompts], [fast.new_cache() for _ in prompts]
    for prompt, a, b in zip(prompts, plain, slots):
        eager.prefill(a, prompt)
        fast.prefill(b, prompt)
    for blocks in ([[3, 11], [12, 13]], [[14, 15, 16], [17, 18, 19]]):
        want, got = eager.verify_batch(plain, blocks), fast.verify_batch(slots, blocks)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.logits, w.logits, atol=1e-4, rtol=1e-4)
    assert fast.eager_batches == 0
