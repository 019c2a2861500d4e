"""Does the draft model pay in int8 or int4? tau and drafting time side by side, as `--quantization` serves them.

    .venv/bin/python scripts/drafter_quantization.py [threads] [prompts] [limit]

Loads the embedded default target as served (bf16 on a CPU with native bf16, its GGUF's int4 weights where
`--quantization auto` picks them) and the shipped draft model three times: the linears of its draft layers (the
context projection stays dense: the model reads its weight's dtype and device) dense and prepacked as the drafter
worker serves them, per-channel int8, and Q4_1-style int4 quantized at load (models/weight_only.py). Each runs the
offline round loop of `foresight eval-drafter` (sync, T=0, block 8, J0, the checkpoint's default) over the same
prompts; prints tau, drafting and verification ms per round, and the tokens per second those give (tau / (draft +
verify)): a faster but worse drafter may lose.
"""
import sys

import torch
from torch import nn

from foresight.bench.prompts import load_prompts
from foresight.config import EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer, resolve_drafter_path
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.gguf_weights import Q4Weight
from foresight.models.int4_linear import Int4Linear
from foresight.models.int8_linear import Int8Linear
from foresight.models.loading import load_target, load_tokenizer, resolve_target
from foresight.models.quantization import apply_quantization, replace_modules
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.steps import eos_ids
from foresight.training.eval_drafter import speculate
from foresight.training.labelling import chat_ids

KINDS = {"none": None,
         "int8": lambda w, dtype: Int8Linear(w, None, dtype),
         "int4": lambda w, dtype: Int4Linear(Q4Weight.quantize(w), None, dtype)}


def quantize_draft_model(model: nn.Module, make) -> int:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is None
             and n.startswith("layers.") and m.in_features % 32 == 0]
    dtype = next(model.parameters()).dtype
    replace_modules(model, names, lambda name, linear: make(linear.weight, dtype))
    return len(names)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    prompt_set = sys.argv[2] if len(sys.argv) > 2 else "chat"
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    torch.set_num_threads(threads)
    path = resolve_target(None)
    target = load_target(path, torch.bfloat16, "cpu")
    served = apply_quantization(target, "auto", path, "cpu", "target")
    tokenizer = load_tokenizer(path)
    prompts = [chat_ids(tokenizer, item["messages"], True) if "messages" in item
               else tokenizer.encode(item["prompt"], add_special_tokens=False)
               for item in load_prompts(prompt_set, limit)]
    eos = eos_ids(target)
    print(f"target bf16 {served}, {threads} thread(s), {len(prompts)} {prompt_set} prompts, 96 tokens, T=0, block 8")
    for kind, make in KINDS.items():
        proposer = JetSpecProposer.load(resolve_drafter_path(EngineConfig()), target, "cpu", torch.bfloat16)
        count = quantize_draft_model(proposer.model, make) if make else 0
        use_cpu_linears(proposer.model, "prepacked", "cpu", "draft model")
        runner = TargetRunner.for_proposer(target, proposer)
        rounds = committed = 0
        draft_s = verify_s = 0.0
        for i, prompt in enumerate(prompts):
            r = speculate(runner, proposer, prompt, 96, 0.0, 8, i, eos)
            rounds += len(r["accepted"])
            committed += sum(a + 1 for a in r["accepted"])
            draft_s, verify_s = draft_s + r["draft_s"], verify_s + r["verify_s"]
        tau, draft_ms, verify_ms = committed / rounds, 1e3 * draft_s / rounds, 1e3 * verify_s / rounds
        print(f"{kind:>4} ({count} linears): tau {tau:.3f}  draft {draft_ms:5.2f} ms  verify {verify_ms:5.2f} ms  "
              f"-> {1e3 * tau / (draft_ms + verify_ms):6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
