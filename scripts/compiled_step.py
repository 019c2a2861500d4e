"""Compiled steps against eager ones on the embedded default, side by side (`--compile on` vs `off`).

    .venv/bin/python scripts/compiled_step.py [threads] [quantization]

Loads the target as served (bf16 where the CPU has native bf16; `quantization` int4 by default, or none),
builds its compiled steps for up to `threads` threads, with the prompt-chunk graph of 9 to 256 tokens
(models/compiled_step.py: loaded from the cache folder when an earlier run compiled them, else compiled now,
minutes), then times, at every thread count from 1 to `threads`, interleaved over one 200-token context per
runner: a 1-token step and verify blocks of 2, 4 and 8 positions (each rolled back); and prompts of 16, 64, 128 and
256 tokens prefilled into an empty cache. Prints medians in ms, the compile time, and the largest logit difference
between the two runners.
"""
import statistics
import sys
import time

import torch

from foresight.models.compiled_step import compiled_step_for
from foresight.models.quantization import apply_quantization
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import cache_root, load_target, resolve_dtype, resolve_target
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner

ROUNDS = 24
BLOCKS = (1, 2, 4, 8)
PROMPTS = (16, 64, 128, 256)
CHUNK = (9, 256)  # the served prompt-chunk graph (target_worker/worker.py, prompt_chunk_tokens)


def served(quantization: str):
    path = resolve_target(None)
    model = load_target(path, resolve_dtype("auto", "cpu"), "cpu")
    apply_quantization(model, quantization, path, "cpu", quantization)
    use_cpu_linears(model, "auto", "cpu", quantization)
    return model


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    model = served(sys.argv[2] if len(sys.argv) > 2 else "int4")
    t0 = time.perf_counter()
    compiled = compiled_step_for(model, "on", "cpu", (), max(BLOCKS), cache_root() / "compiled", packed_attention,
                                 threads=threads, chunk_tokens=CHUNK)
    print(f"compiled steps ready in {time.perf_counter() - t0:.1f} s ({compiled.compile_s:.1f} s compiling, "
          f"{compiled.loaded} loaded)")
    runners = {"eager": TargetRunner(model), "compiled": TargetRunner(model, compiled=compiled)}
    caches = {}
    for name, runner in runners.items():
        caches[name] = runner.new_cache()
        runner.prefill(caches[name], [100 + (7 * i) % 3000 for i in range(200)])
    worst = 0.0
    for n, count in ((n, count) for count in range(1, threads + 1) for n in BLOCKS):
        torch.set_num_threads(count)
        times = {name: [] for name in runners}
        logits = {}
        for i in range(ROUNDS):
            for name in (list(runners) if i % 2 else list(runners)[::-1]):
                block = [5 + j for j in range(n)]
                t0 = time.perf_counter()
                logits[name] = runners[name].verify(caches[name], block[0], block[1:]).logits
                times[name].append(time.perf_counter() - t0)
                caches[name].crop(-n)
        worst = max(worst, (logits["eager"] - logits["compiled"]).abs().max().item())
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        print(f"{count} thread(s), {n}-token forward: eager {ms['eager']:6.2f} ms  compiled {ms['compiled']:6.2f} ms  "
              f"compiled {ms['eager'] / ms['compiled']:.2f}x")
    for n, count in ((n, count) for count in range(1, threads + 1) for n in PROMPTS):
        torch.set_num_threads(count)
        times = {name: [] for name in runners}
        for i in range(ROUNDS // 2):
            for name in (list(runners) if i % 2 else list(runners)[::-1]):
                cache = runners[name].new_cache()
                t0 = time.perf_counter()
                logits[name] = runners[name].prefill(cache, [100 + (7 * j) % 3000 for j in range(n)]).logits
                times[name].append(time.perf_counter() - t0)
        worst = max(worst, (logits["eager"] - logits["compiled"]).abs().max().item())
        ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
        print(f"{count} thread(s), {n}-token prompt: eager {ms['eager']:6.2f} ms  compiled {ms['compiled']:6.2f} ms  "
              f"compiled {ms['eager'] / ms['compiled']:.2f}x")
    print(f"largest |eager - compiled| logit: {worst:.4f}; eager forwards of the compiled runner: "
          f"{runners['compiled'].eager_forwards}")


if __name__ == "__main__":
    main()
