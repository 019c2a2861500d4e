"""Median time of one batched target step against the number of requests in it (the ceiling of batching).

    .venv/bin/python scripts/batch_step.py [float32|bfloat16] [threads] [auto|prepacked|plain]

Linear layers as the server's `--cpu-linear` (third argument, default auto). Each request holds its own
200-token context (`TargetRunner.prefill`); a step feeds one token per request through
`TargetRunner.verify_batch`, as the target worker's plain steps under load do (B = 1: `verify`).
Throughput at B requests over one request's is B x (one-request step) / (B-request step): what `ar` at B
clients could reach if nothing but the forward cost time (no prefills, sampling, messages or HTTP).
"""
import statistics
import sys
import time

import torch

from foresight.target_worker.cpu_linear import use_cpu_linears
from foresight.target_worker.loading import load_target, resolve_target
from foresight.target_worker.runner import TargetRunner


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
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    model = load_target(resolve_target(None), dtype, "cpu")
    use_cpu_linears(model, sys.argv[3] if len(sys.argv) > 3 else "auto", "cpu", "target")  # as the server does
    runner = TargetRunner(model)
    one = None
    for requests in (1, 2, 4, 8, 16):
        ms = median_step_ms(runner, requests)
        one = one or ms
        print(f"{dtype} {requests:2d} requests: {ms:.1f} ms/step ({ms / one:.2f}x one request's step, "
              f"{requests * one / ms:.2f}x its throughput)", flush=True)


if __name__ == "__main__":
    main()
