"""4-bit weights as a GGUF ships them, served by torch's int4 kernel: reading, packing, logits, greedy modes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from foresight.config import ConfigError, EngineConfig
from foresight.models.gguf_weights import BLOCK, Q4Weight, _q4_blocks, read_q4_weights
from foresight.models.int4_linear import INT4_MAX_ROWS, Int4Linear
from foresight.models.quantization import quantize_model, resolve_quantization
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)


def _gguf_dequantize(data: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(data, qtype)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_dequantize_as_the_gguf_package_does(qtype):
    rng = np.random.default_rng(0)
    dense = rng.normal(0, 0.05, size=(48, 96)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(dense, kind)  # [48, bytes] uint8
    weight = _q4_blocks(data, qtype, 96)
    assert weight.shape == (48, 96) and int(weight.codes.max()) <= 15
    assert torch.equal(weight.dequantize(), torch.from_numpy(_gguf_dequantize(data, kind)))


def test_quantize_is_llama_cpp_q4_1():
    rng = np.random.default_rng(1)
    dense = rng.normal(0, 0.05, size=(16, 64)).astype(np.float32)
    ours = Q4Weight.quantize(torch.from_numpy(dense))
    theirs = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(ours.dequantize(), torch.from_numpy(_gguf_dequantize(theirs, gguf.GGMLQuantizationType.Q4_1)))


def _random_q4(out: int, inp: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    d = (torch.rand(out, inp // BLOCK, generator=g) * 0.01).half().float()
    m = (-torch.rand(out, inp // BLOCK, generator=g) * 0.05).half().float()
    return Q4Weight(codes, d, m)


def test_int4_packing_round_trips_exactly():
    """Unpacking through the kernel itself (identity activations, scale 1, zero 8: w = q) gives every code back."""
    weight = _random_q4(48, 64)
    layer = Int4Linear(weight, None, torch.float32)
    unit = torch.tensor([1.0, 8.0]).expand(64 // BLOCK, 48, 2).contiguous()
    columns = torch._weight_int4pack_mm_for_cpu(torch.eye(64), layer.packed, BLOCK, unit)  # [in, out]
    assert torch.equal(columns.t().to(torch.uint8), weight.codes)


@pytest.mark.parametrize("rows", [1, 3, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40])
def test_int4_linear_matches_its_weights_in_fp32(rows):
    """Kernel (few rows) and dense copy (many rows) multiply by the same weights, the file's d q + m."""
    weight = _random_q4(48, 64, seed=rows)
    bias = torch.randn(48)
    layer = Int4Linear(weight, bias, torch.float32)
    x = torch.randn(2, rows, 64)
    want = x @ weight.dequantize().t() + bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_int4_linear_in_bf16_within_the_documented_tolerance():
    """bf16 rounds the scale and zero point to 8 bits (docs/numerics.md, "The int4 target")."""
    weight = _random_q4(96, 128)
    layer = Int4Linear(weight, None, torch.bfloat16)
    x = torch.randn(4, 128)
    want = x @ weight.dequantize().t()
    got = layer(x.bfloat16()).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (pairs of adjacent rotary dimensions)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_q4_gguf(model, path) -> int:
    """Write `model`'s (a tiny Llama) decoder linears as a Q4_1 GGUF, as llama.cpp's converter lays them out,
    and set the model's weights to their dequantized values (what converting the file back gives). The
    number of tensors written."""
    writer = gguf.GGUFWriter(str(path), "llama")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".layers." not in name:
            continue
        data = gguf.quants.quantize(module.weight.detach().numpy(), gguf.GGMLQuantizationType.Q4_1)
        dense = _gguf_dequantize(data, gguf.GGMLQuantizationType.Q4_1)
        module.weight.data = torch.from_numpy(dense)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in heads:
            data = _llama_cpp_permute(data, heads[leaf])
        writer.add_tensor(f"{names.get_name(name)}.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama whose linears are the Q4_1 weights of the GGUF file beside it."""
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    count = write_q4_gguf(model, path)
    return model, path, count


def test_gguf_weights_are_found_by_module_and_unpermuted(tiny_gguf):
    model, path, count = tiny_gguf
    weights = read_q4_weights(path, model)
    assert len(weights) == count == 7 * model.config.num_hidden_layers
    for name, weight in weights.items():
        assert torch.equal(weight.dequantize(), model.get_submodule(name).weight), name


def test_int4_logits_match_the_dequantized_model(tiny_gguf):
    model, path, _ = tiny_gguf
    served = tiny_model("llama")
    served.load_state_dict(model.state_dict())
    assert quantize_model(served, "int4", path, "test") == 21
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    with torch.inference_mode():
        want = model(ids).logits
        torch.testing.assert_close(served(ids).logits, want, rtol=1e-4, atol=1e-4)  # dense copy (12 rows)
        torch.testing.assert_close(served(ids[:, :4]).logits, want[:, :4], rtol=1e-4, atol=1e-4)  # kernel


def test_auto_picks_int4_only_where_it_is_the_shipped_precision_and_fast(tiny_gguf):
    _, path, _ = tiny_gguf
    assert resolve_quantization("auto", path, torch.bfloat16, "cpu") == "int4"
    assert resolve_quantization("auto", path, torch.float32, "cpu") == "none"  # the kernel's slow path
    assert resolve_quantization("auto", None, torch.bfloat16, "cpu") == "none"  # dense weights as shipped
    assert resolve_quantization("none", path, torch.bfloat16, "cpu") == "none"
    with pytest.raises(ConfigError, match="quantization"):
        resolve_quantization("int4", path, torch.bfloat16, "cuda:0")
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int3")


def test_every_greedy_mode_equals_plain_greedy_on_the_int4_target():
    """Lossless with respect to the target as served: the int4 model's own plain greedy decoding (no cache,
    whole sequences: its dense copy) against every mode's (1-row steps and blocks: the kernel). The drafts
    are the target's own continuation with every third token wrong (support/oracle_proposer.py), so blocks
    are partly accepted and rolled back; prompt lookup and auto run beside them."""
    model = tiny_model("llama", seed=3)
    assert quantize_model(model, "int4", None, "test") == 21  # quantized at load: no GGUF source
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 17, 3, 17, 3, 17, 60, 61, 62]]
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=6),
                             proposer=OracleForesight(model, share=True))  # fp32 Llama: no hooks to race
    try:
        accepted = rejected = 0
        for prompt in prompts:
            want = plain_greedy(model, prompt, 30, eos=model.config.eos_token_id)
            for mode in ("ar", "ngram", "sync", "pipelined", "auto"):
                got = engine.generate(prompt, 30, mode=mode, temperature=0.0)
                assert got["error"] is None and got["tokens"] == want, (mode, prompt)
                accepted += sum(r.accepted for r in got["rounds"])
                rejected += sum(r.drafted - r.accepted for r in got["rounds"])
    finally:
        engine.close()
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_a_converted_folder_remembers_its_gguf(tmp_path, tiny_gguf):
    from foresight.models.loading import GGUF_SOURCE_FILE, gguf_source

    _, path, _ = tiny_gguf
    folder = tmp_path / "converted"
    folder.mkdir()
    assert gguf_source(folder) is None  # dense weights as shipped
    (folder / GGUF_SOURCE_FILE).write_text(json.dumps({"gguf": str(path)}))
    assert gguf_source(folder) == path
    (folder / GGUF_SOURCE_FILE).write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    assert gguf_source(folder) is None
