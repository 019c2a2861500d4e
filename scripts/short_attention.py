"""Whole target forwards with folded short-query attention against transformers' SDPA only, interleaved.

    .venv/bin/python scripts/short_attention.py [float32|bfloat16] [threads] [rounds]

The default target, linear layers as the server prepacks them, each request holding its own 250-token
context. Each round times every (dispatch, requests x positions) once, in turn, so a drifting machine
slows both dispatches alike; the block's positions are cropped again after each step. Prints the median
step of each dispatch and the ratio (above 1: folding is faster).
"""
import statistics
import sys
import time

import torch

from batch_step import contexts  # scripts/, beside this one

from foresight.target_worker import packed_step
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import load_target, resolve_target
from foresight.target_worker.runner import TargetRunner

SHAPES = [(1, 1), (1, 8), (8, 1), (8, 4), (16, 1)]  # (requests, positions per request)
CONTEXT = 250
FOLDED = packed_step.takes_folded_path


def sdpa_only(*args) -> bool:
    return False


def step(runner: TargetRunner, caches: list, positions: int) -> float:
    block = [5] + [6] * (positions - 1)
    t0 = time.perf_counter()
    if len(caches) == 1:
        runner.verify(caches[0], block[0], block[1:])
    else:
        runner.verify_batch(caches, [block] * len(caches))
    elapsed = time.perf_counter() - t0
    for cache in caches:
        cache.crop(-positions)
    return elapsed


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    model = load_target(resolve_target(None), dtype, "cpu")
    use_cpu_linears(model, "auto", "cpu", "target")
    dispatches = {"folded": FOLDED, "sdpa": sdpa_only}
    runners = {name: TargetRunner(model) for name in dispatches}  # one each: a batched layout is per runner
    caches = {(name, shape): contexts(runners[name], shape[0], CONTEXT) for name in dispatches for shape in SHAPES}
    times = {key: [] for key in caches}
    for _ in range(rounds):
        for (name, (requests, positions)), rows in caches.items():
            packed_step.takes_folded_path = dispatches[name]
            times[name, (requests, positions)].append(step(runners[name], rows, positions))
    packed_step.takes_folded_path = FOLDED
    for shape in SHAPES:
        folded, sdpa = (statistics.median(times[name, shape][2:]) * 1e3 for name in dispatches)
        print(f"{dtype} {torch.get_num_threads()} threads, {shape[0]:2d} requests x {shape[1]} positions: "
              f"folded {folded:.1f} ms, SDPA {sdpa:.1f} ms ({sdpa / folded:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
