"""Do the compiled foresight adapter and decoder pay? Foresight's prediction time per round, eager against compiled.

    .venv/bin/python scripts/compiled_decoder.py [threads] [prompts] [limit] [bfloat16|float32]

Loads the embedded default target as served in that dtype (bf16 by default; its GGUF's int4 weights where
`--quantization auto` picks them; its steps eager: only the drafter's time is compared) and the shipped foresight
drafter twice, as the drafter worker serves it (`make_proposer`), once with `--drafter-compile off` and once with
`auto` (the draft model's pass, the adapter's prediction and the decoder's pass compiled: models/compiled_adapter.py,
models/compiled_decoder.py). Then replays speculative decoding over the prompts (`foresight eval-foresight`'s replay:
T=0, block 8, 96 tokens), the two drafters taking the prompts in turn, and prints per drafter: the median prediction
time of a round (the adapter and the decoder over the block under verification, with the round's new context
states), the replayed hit rate at B = 1, 2, 4, and how many passes the compiled adapter and decoder ran.
"""
import statistics
import sys
from pathlib import Path

import torch

from foresight.bench.prompts import load_prompts
from foresight.config import EngineConfig
from foresight.drafter_worker.worker import make_proposer
from foresight.models.loading import load_target, load_tokenizer, resolve_target
from foresight.models.quantization import apply_quantization
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.steps import eos_ids
from foresight.training.eval_foresight import replay
from foresight.training.labelling import chat_ids

SIZES = [1, 2, 4]


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    prompt_set = sys.argv[2] if len(sys.argv) > 2 else "chat"
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    torch.set_num_threads(threads)
    path = resolve_target(None)
    target = load_target(path, getattr(torch, dtype), "cpu")
    served = apply_quantization(target, "auto", path, "cpu", "target")
    drafters = {name: make_proposer(EngineConfig(dtype=dtype, drafter_compile=choice, drafter_threads=threads))
                for name, choice in (("eager", "off"), ("compiled", "auto"))}
    compiled = drafters["compiled"].scorer.decoder.compiled
    print(f"target {served} {dtype}, {threads} thread(s); compiled decoder: "
          f"{'none' if compiled is None else 'loaded' if compiled.loaded else f'{compiled.compile_s:.1f} s compiling'}",
          flush=True)
    tokenizer = load_tokenizer(Path(path))
    prompts = [chat_ids(tokenizer, item["messages"], True) if "messages" in item
               else tokenizer.encode(item["prompt"], add_special_tokens=False)
               for item in load_prompts(prompt_set, limit)]
    runner = TargetRunner.for_proposer(target, drafters["eager"])
    runs = {name: [] for name in drafters}
    for i, prompt in enumerate(prompts):
        for name in (list(drafters) if i % 2 else list(drafters)[::-1]):
            runs[name].append(replay(runner, drafters[name], prompt, 96, 8, eos_ids(target), SIZES, 0.0, i))
    for name, results in runs.items():
        rounds = sum(r["rounds"] for r in results)
        hits = " ".join(f"B{b}={sum(r['hits']['eq6'][b] for r in results) / rounds:.3f}" for b in SIZES)
        predict = 1e3 * statistics.median(s for r in results for s in r["predict_s"])
        print(f"{name:>8}: predict {predict:6.2f} ms a round (median of {rounds} rounds), hit rate {hits}", flush=True)
    if compiled is not None:
        print(f"compiled decoder passes: {compiled.passes} (single-row passes left eager: {compiled.eager_passes})")
    adapter = drafters["compiled"].scorer.adapter.compiled
    if adapter is not None:
        print(f"compiled adapter predictions: {adapter.passes} (left eager: {adapter.eager_passes})")


if __name__ == "__main__":
    main()
