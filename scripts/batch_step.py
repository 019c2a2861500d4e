"""Median time of one batched target step against the number of requests in it (the ceiling of batching), eager
and, with `compiled`, through the compiled steps (models/compiled_step.py: the batched graphs).

    .venv/bin/python scripts/batch_step.py [float32|bfloat16] [threads] [auto|prepacked|plain] [none|int4|int8]
        [compiled] [tokens] [padded]

Linear layers as the server's `--cpu-linear` (third argument, default auto) and `--quantization` (fourth, default
none). Each request holds its own 200-token context (`TargetRunner.prefill`); a step feeds `tokens` (default 1) per
request through `TargetRunner.verify_batch`, as the target worker's plain steps (1) and verify blocks under load do
(B = 1: `verify`), and crops them again; `tokens` may list lengths that requests take in turn ("8,1": one request's
8-token block beside another's single token). Compiled: the graphs the server builds for the embedded default (the
same packages: one request's 1-8 tokens, the 1-token graph of the quantized kernel's rows and the blocks' graph of
up to 8 tokens per request, returning the states its drafter reads); `padded` sends every batch to the blocks'
graph however far its rows are padded (else a batch padded past MAX_PADDING runs eager, as in the server).
Throughput at B requests over one request's is B x (one-request step) / (B-request step): what `ar` at B
clients could reach if nothing but the forward cost time (no prefills, sampling, messages or HTTP).
"""
import statistics
import sys
import time

import torch

from foresight.models.compiled_step import CompiledStep, batch_ranges, step_buckets
from foresight.models.int4_linear import serves_int4
from foresight.models.quantization import apply_quantization
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import cache_root, load_target, resolve_target
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner

REQUESTS = (1, 2, 4, 8, 12, 16)
SERVED_LAYERS = (3, 15, 27, 30)  # the target states the embedded default's drafter reads (the server's graphs)
BLOCK = 8  # the server's --block-size


def contexts(runner: TargetRunner, requests: int, length: int = 200) -> list:
    """One cache per request, each holding its own `length`-token context."""
    caches = []
    for b in range(requests):
        cache = runner.new_cache()
        runner.prefill(cache, [100 + (7 * b + i) % 3000 for i in range(length)])  # a different context each
        caches.append(cache)
    return caches


def median_step_ms(runner: TargetRunner, requests: int, lengths: list[int], steps: int = 25) -> float:
    caches = contexts(runner, requests)
    blocks = [[5 + i for i in range(lengths[b % len(lengths)])] for b in range(requests)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if requests == 1:
            runner.verify(caches[0], blocks[0][0], blocks[0][1:])
        else:
            runner.verify_batch(caches, blocks)
        times.append(time.perf_counter() - t0)
        for cache, block in zip(caches, blocks):
            cache.crop(-len(block))
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    args = sys.argv[1:] + [None] * 7
    dtype = getattr(torch, args[0] or "float32")
    threads = int(args[1] or 2)
    lengths = [int(n) for n in (args[5] or "1").split(",")]
    torch.set_num_threads(threads)
    path = resolve_target(None)
    model = load_target(path, dtype, "cpu")
    apply_quantization(model, args[3] or "none", path, "cpu", "target")
    use_cpu_linears(model, args[2] or "auto", "cpu", "target")  # as the server does
    runners = {}
    if args[4] == "compiled":  # before any runner: a runner's logit head hooks the final norm, which the trace runs
        compiled = CompiledStep(model, SERVED_LAYERS, step_buckets(BLOCK), cache_root() / "compiled",
                                autotune=serves_int4(model), attention=packed_attention, threads=threads,
                                batch_ranges=batch_ranges(model), block_tokens=BLOCK)
        compiled.build()
        if args[6] == "padded":
            compiled.max_padding = float("inf")
        runners["compiled"] = TargetRunner(model, compiled=compiled)
    runners = {"eager": TargetRunner(model), **runners}
    one = {}
    for requests in REQUESTS:
        ms = {name: median_step_ms(runner, requests, lengths) for name, runner in runners.items()}
        cells = []
        for name, step_ms in ms.items():
            one.setdefault(name, step_ms)
            cells.append(f"{name} {step_ms:5.1f} ms/step ({requests * one[name] / step_ms:.2f}x its one-request "
                         f"throughput)")
        if "compiled" in ms:
            cells.append(f"compiled {ms['eager'] / ms['compiled']:.2f}x eager")
        print(f"{dtype} {threads}t {requests:2d} requests x {','.join(map(str, lengths))} tokens: " + "; ".join(cells),
              flush=True)
    if "compiled" in runners:
        print(f"eager batched steps of the compiled runner: {runners['compiled'].eager_batches}")


if __name__ == "__main__":
    main()
