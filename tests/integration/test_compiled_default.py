"""Compiled steps on the embedded default as `--compile auto` serves them (int4 weights, bf16 activations):
the compiled 1-token step is as close to the fp32 forward as the eager step is (docs/numerics.md, "Compiled
steps"). Compiles one bucket (about a minute on 2 cores) into the cache folder, or loads it from there."""
from __future__ import annotations

import pytest
import torch

from foresight.models.compiled_step import CompiledStep
from foresight.models.quantization import apply_quantization
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import cache_root, cpu_supports_bf16, load_target, load_tokenizer, resolve_target
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner
from test_int4_default import TEXT, relative_errors

pytestmark = pytest.mark.skipif(not cpu_supports_bf16(), reason="compile auto compiles the int4 target (bf16 only)")

STEPS = 8  # positions fed one at a time after the prompt


def stepped_logits(runner: TargetRunner, ids: list[int]) -> torch.Tensor:
    """[STEPS, vocab]: the prompt but its last STEPS tokens prefilled, then one token per forward."""
    cache = runner.new_cache()
    runner.prefill(cache, ids[:-STEPS])
    return torch.cat([runner.forward(cache, [token]).logits for token in ids[-STEPS:]])


def test_the_compiled_int4_step_is_as_close_to_fp32_as_the_eager_one():
    path = resolve_target(None)
    torch.set_num_threads(1)
    ids = load_tokenizer(path)(TEXT)["input_ids"]
    with torch.inference_mode():
        want = load_target(path, torch.float32, "cpu")(torch.tensor([ids])).logits[0, -STEPS:]  # [STEPS, vocab]
    model = load_target(path, torch.bfloat16, "cpu")
    assert apply_quantization(model, "auto", path, "cpu", "test") == "int4"
    use_cpu_linears(model, "auto", "cpu", "test")
    compiled = CompiledStep(model, (), (1,), cache_root() / "compiled", autotune=True, attention=packed_attention)
    compiled.build()
    eager = stepped_logits(TargetRunner(model), ids)
    fast_runner = TargetRunner(model, compiled=compiled)
    fast = stepped_logits(fast_runner, ids)
    assert fast_runner.eager_forwards == 1  # the prompt (this build has no prompt-chunk graph)
    eager_err, fast_err = relative_errors(eager, want), relative_errors(fast, want)
    # Measured: see docs/numerics.md, "Compiled steps".
    assert fast_err.mean() <= 1.5 * eager_err.mean() and fast_err.max() <= 0.15, (fast_err, eager_err)
    assert (fast.argmax(-1) == want.argmax(-1)).float().mean() >= (eager.argmax(-1) == want.argmax(-1)).float().mean() - 0.25
