"""A prompt's chunk beside other requests' rounds: one eager forward of both against the compiled graphs apart.

    .venv/bin/python scripts/chunk_beside_rounds.py [threads] [float32|bfloat16]

Loads the embedded default target as served (`--quantization auto`, `--cpu-linear auto`) and the compiled steps the
server builds for it (the same packages: buckets, batched graphs, the prompt-chunk graph of 9-256 tokens). Each
request holds its own 200-token context. For B requests' blocks beside a prompt's next chunk it times (median of
10 steps, each cropped again) what the target worker ran before compiled steps took chunks (`verify_batch` with the
chunk: no graph takes both, so one eager packed forward) and what it runs now (`TargetRunner.shares_chunks` false:
the blocks through their graph, then the chunk through the chunk graph), and prints the ratio.
"""
import statistics
import sys
import time

import torch

from foresight.models.compiled_step import CompiledStep, batch_ranges, step_buckets
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.int4_linear import serves_int4
from foresight.models.loading import cache_root, load_target, resolve_target
from foresight.models.quantization import apply_quantization
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner

from batch_step import BLOCK, SERVED_LAYERS, contexts

CASES = ((1, 1, 64), (4, 1, 64), (8, 1, 64), (8, 1, 200), (4, 4, 32))  # (requests, block tokens, chunk tokens)


def step_ms(runner: TargetRunner, caches: list, blocks: list[list[int]], chunk_cache, chunk: list[int],
            together: bool, steps: int = 12) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if together:
            runner.verify_batch(caches, blocks, (chunk_cache, chunk))
        else:
            if len(blocks) == 1:
                runner.verify(caches[0], blocks[0][0], blocks[0][1:])
            else:
                runner.verify_batch(caches, blocks)
            runner.prefill(chunk_cache, chunk)
        times.append(time.perf_counter() - t0)
        for cache, block in zip(caches, blocks):
            cache.crop(-len(block))
        chunk_cache.crop(-len(chunk))
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
    torch.set_num_threads(threads)
    path = resolve_target(None)
    model = load_target(path, dtype, "cpu")
    served = apply_quantization(model, "auto", path, "cpu", "target")
    use_cpu_linears(model, "auto", "cpu", "target")
    compiled = CompiledStep(model, SERVED_LAYERS, step_buckets(BLOCK), cache_root() / "compiled",
                            autotune=serves_int4(model), attention=packed_attention, threads=threads,
                            batch_ranges=batch_ranges(model), block_tokens=BLOCK, chunk_tokens=(BLOCK + 1, 256))
    compiled.build()
    runner = TargetRunner(model, compiled=compiled)
    print(f"target {served} {str(dtype).removeprefix('torch.')}, {threads} thread(s)", flush=True)
    for requests, block, chunk_tokens in CASES:
        caches = contexts(runner, requests + 1)
        chunk_cache = caches.pop()
        blocks = [[5 + i for i in range(block)] for _ in range(requests)]
        chunk = [300 + i for i in range(chunk_tokens)]
        together = step_ms(runner, caches, blocks, chunk_cache, chunk, True)
        apart = step_ms(runner, caches, blocks, chunk_cache, chunk, False)
        print(f"{requests} requests x {block} tokens beside a {chunk_tokens}-token chunk: one eager forward "
              f"{together:.1f} ms, compiled apart {apart:.1f} ms ({together / apart:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
