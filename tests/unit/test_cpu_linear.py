"""Linear layers prepacked for oneDNN (models/cpu_linear.py): the same products as nn.Linear up to
float rounding, the same weights for whatever else reads them, and greedy speculative output still equal
to plain greedy decoding of the prepacked model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foresight.config import EngineConfig
from foresight.models import cpu_linear
from foresight.models.cpu_linear import PrepackedLinear, prepack_linears, prepacking_available, use_cpu_linears
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
    with pytest.raises(ValueError, match="cpu_linear"):
        use_cpu_linears(fp32, "fast", "cpu", "test")


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_prepacks_bf16_only_where_the_cpu_multiplies_bf16_natively(native_bf16, monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_supports_bf16", lambda: native_bf16)
    bf16 = tiny_model("llama").to(torch.bfloat16)
    expected = native_bf16 and prepacking_available(torch.bfloat16)
    assert use_cpu_linears(bf16, "auto", "cpu", "test") == expected
    assert any(isinstance(m, PrepackedLinear) for m in bf16.modules()) == expected


@pytest.mark.skipif(not prepacking_available(torch.bfloat16), reason="oneDNN cannot prepack bf16 on this CPU")
def test_prepacked_bf16_keeps_the_predictions():
    model = tiny_model("llama").to(torch.bfloat16)
    packed = copy.deepcopy(model)
    prepack_linears(packed)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        plain_logits, packed_logits = model(ids).logits.float(), packed(ids).logits.float()
    torch.testing.assert_close(packed_logits, plain_logits, atol=2e-2, rtol=2e-2)
    assert torch.equal(packed_logits.argmax(-1), plain_logits.argmax(-1))
