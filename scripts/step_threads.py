"""Median step time of the embedded default target at one and two threads, and toggled every step.

    .venv/bin/python scripts/step_threads.py [bfloat16|float32]

A plain step (no drafts) and a 4-draft verification over a 200-token context; what `--borrow-drafter-threads`
gains per step when the drafter idles.
"""
import statistics
import sys
import time

import torch

from foresight.models.loading import load_target, resolve_target
from foresight.target_worker.runner import TargetRunner


def median_step_ms(runner: TargetRunner, threads, drafts: int, steps: int = 60) -> float:
    cache = runner.new_cache()
    runner.prefill(cache, list(range(100, 300)))
    times = []
    for i in range(steps):
        torch.set_num_threads(threads(i))
        t0 = time.perf_counter()
        result = runner.verify(cache, 5, [7] * drafts)
        runner.rollback(cache, drafts, result)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    runner = TargetRunner(load_target(resolve_target(None), dtype, "cpu"), [])
    for drafts in (0, 4):
        one = median_step_ms(runner, lambda i: 1, drafts)
        two = median_step_ms(runner, lambda i: 2, drafts)
        toggled = median_step_ms(runner, lambda i: 1 + i % 2, drafts)
        print(f"{dtype} {drafts} drafts: 1 thread {one:.1f} ms, 2 threads {two:.1f} ms ({one / two:.2f}x), "
              f"toggled every step {toggled:.1f} ms")


if __name__ == "__main__":
    main()
