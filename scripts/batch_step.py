"""Median time of one batched target step against the number of requests in it (the ceiling of batching), eager
and, with `compiled`, through the compiled steps (models/compiled_step.py: the batched graphs of one token per request).

    .venv/bin/python scripts/batch_step.py [float32|bfloat16] [threads] [auto|prepacked|plain] [none|int4] [compiled]

Linear layers as the server's `--cpu-linear` (third argument, default auto) and `--quantization` (fourth, default
none). Each request holds its own 200-token context (`TargetRunner.prefill`); a step feeds one token per request
through `TargetRunner.verify_batch`, as the target worker's plain steps under load do (B = 1: `verify`).
Throughput at B requests over one request's is B x (one-request step) / (B-request step): what `ar` at B
clients could reach if nothing but the forward cost time (no prefills, sampling, messages or HTTP).
"""
import statistics
import sys
import time

import torch

from foresight.models.compiled_step import compiled_step_for
from foresight.models.quantization import apply_quantization
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import cache_root, load_target, resolve_target
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner

REQUESTS = (1, 2, 4, 8, 12, 16)


def contexts(runner: TargetRunner, requests: int, length: int = 200) -> list:
    """One cache per request, each holding its own `length`-token context."""
    caches = []
    for b in range(requests):
        cache = runner.new_cache()
        runner.prefill(cache, [100 + (7 * b + i) % 3000 for i in range(length)])  # a different context each
        caches.append(cache)
    return caches


def median_step_ms(runner: TargetRunner, requests: int, steps: int = 25) -> float:
    caches = contexts(runner, requests)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if requests == 1:
            runner.verify(caches[0], 5, [])
        else:
            runner.verify_batch(caches, [[5]] * requests)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    args = sys.argv[1:] + [None] * 5
    dtype = getattr(torch, args[0] or "float32")
    threads = int(args[1] or 2)
    torch.set_num_threads(threads)
    path = resolve_target(None)
    model = load_target(path, dtype, "cpu")
    apply_quantization(model, args[3] or "none", path, "cpu", "target")
    use_cpu_linears(model, args[2] or "auto", "cpu", "target")  # as the server does
    runners = {"eager": TargetRunner(model)}
    if args[4] == "compiled":
        compiled = compiled_step_for(model, "on", "cpu", (), 1, cache_root() / "compiled", packed_attention,
                                     threads=threads, batched=True)
        runners["compiled"] = TargetRunner(model, compiled=compiled)
    one = {}
    for requests in REQUESTS:
        ms = {name: median_step_ms(runner, requests) for name, runner in runners.items()}
        cells = []
        for name, step_ms in ms.items():
            one.setdefault(name, step_ms)
            cells.append(f"{name} {step_ms:5.1f} ms/step ({requests * one[name] / step_ms:.2f}x its one-request "
                         f"throughput)")
        if "compiled" in ms:
            cells.append(f"compiled {ms['eager'] / ms['compiled']:.2f}x eager")
        print(f"{dtype} {threads}t {requests:2d} requests: " + "; ".join(cells), flush=True)
    if "compiled" in runners:
        print(f"eager batched steps of the compiled runner: {runners['compiled'].eager_batches}")


if __name__ == "__main__":
    main()
