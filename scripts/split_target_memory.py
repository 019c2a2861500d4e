"""Memory per device of a target split by tensor parallelism (`foresight serve --tensor-parallel-size N`), computed
from its config the way transformers shards it: the parameters its tensor-parallel plan names are divided among the
ranks, the others replicated (a tied embedding follows the LM head); rank 0 also holds the whole LM head once more in
the serving dtype when that is narrower than fp32 (its fp32 logit head recomputes the top logits from it). KV cache
per token per device: every full-attention layer's keys and values for the rank's share of the KV heads.

    python scripts/split_target_memory.py                     # Llama-3-70B's shape, bf16, 2/4/8 GPUs of 80 GB
    python scripts/split_target_memory.py --config PATH/config.json --sizes 2,4 --gpu-gb 141

The model is built on the meta device: nothing is allocated and no weights are read.
"""
from __future__ import annotations

import argparse
import fnmatch
import json

import torch

LLAMA_3_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
               "tie_word_embeddings": False, "max_position_embeddings": 131072}
RESERVED_GB = 3.0  # the CUDA context and activations, per device
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg), cfg


def sharded(name: str, plan: dict[str, str]) -> bool:
    module = name.rsplit(".", 1)[0]
    return any(fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, "model." + pattern)
               for pattern in plan)


def per_rank(config: dict, size: int, dtype: str, gpu_gb: float) -> dict:
    model, cfg = meta_model(config)
    plan = {**(cfg.base_model_tp_plan or {}), **(getattr(model, "_tp_plan", None) or {})}
    split = whole = 0
    for name, param in model.named_parameters():  # tied weights are listed once
        if sharded(name, plan):
            split += param.numel()
        else:
            whole += param.numel()
    width = BYTES[dtype]
    weights = (split / size + whole) * width
    head = cfg.vocab_size * cfg.hidden_size * width if width < 4 else 0
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads / size
    kv = sum(t == "full_attention" for t in layer_types) * 2 * kv_heads * head_dim * width
    left = gpu_gb * 1e9 - RESERVED_GB * 1e9 - weights - head
    return {"devices": size, "weights_gb": round(weights / 1e9, 1), "rank0_head_gb": round(head / 1e9, 2),
            "kv_kib_per_token": round(kv / 1024, 1), "kv_tokens": int(left // kv) if left > 0 else 0,
            "divides": cfg.num_key_value_heads % size == 0 and cfg.num_attention_heads % size == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a config.json (default: Llama-3-70B's shape)")
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES))
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    args = ap.parse_args()
    config = json.load(open(args.config)) if args.config else LLAMA_3_70B
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(per_rank(config, size, args.dtype, args.gpu_gb)))


if __name__ == "__main__":
    main()
