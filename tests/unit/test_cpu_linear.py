"""Linear layers prepacked for oneDNN (target_worker/cpu_linear.py): the same products as nn.Linear up to
float rounding, the same weights for whatever else reads them, and greedy speculative output still equal
to plain greedy decoding of the prepacked model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foresight.config import EngineConfig
from foresight.target_worker.cpu_linear import PrepackedLinear, prepack_linears, prepacking_available, use_cpu_linears
from support.inprocess import InProcessEngine
from support.tiny_models import plain_greedy, tiny_model

pytestmark = pytest.mark.skipif(not prepacking_available(torch.float32),
                                reason="this torch build has no oneDNN (mkldnn) CPU backend")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48)])
def test_prepacked_linear_multiplies_as_nn_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        wide = torch.randn(*shape[:-1], 96)[..., ::2]  # a strided input
        torch.testing.assert_close(packed(wide), linear(wide), atol=1e-5, rtol=1e-5)


def test_where_autograd_records_it_is_nn_linear():
    linear = nn.Linear(16, 8)
    packed = PrepackedLinear(linear)
    x = torch.randn(3, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_5"])
def test_a_prepacked_model_keeps_its_weights_and_predicts_as_before(arch):
    model = tiny_model(arch)
    plain = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert isinstance(head, PrepackedLinear)
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["ngram", "sync"])
def test_greedy_speculation_on_a_prepacked_target_equals_its_plain_greedy(mode):
    model = tiny_model("llama")
    prepack_linears(model)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 40, 11, 12]]
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6))
    try:
        results = engine.generate_all(prompts, 30, mode=mode, temperature=0.0)
    finally:
        engine.close()
    for result, prompt in zip(results, prompts):
        assert result["error"] is None
        assert result["tokens"] == plain_greedy(model, prompt, 30, eos=model.config.eos_token_id)


def test_the_choice_of_linears():
    fp32 = tiny_model("llama")
    assert not use_cpu_linears(fp32, "plain", "cpu", "test")
    assert not use_cpu_linears(fp32, "auto", "cuda", "test")  # never off the CPU
    assert not any(isinstance(m, PrepackedLinear) for m in fp32.modules())
    assert use_cpu_linears(fp32, "auto", "cpu", "test")
    assert any(isinstance(m, PrepackedLinear) for m in fp32.modules())
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert not use_cpu_linears(bf16, "auto", "cpu", "test")  # auto: fp32 only
    with pytest.raises(ValueError, match="cpu_linear"):
        use_cpu_linears(fp32, "fast", "cpu", "test")
