"""Plain `nn.Linear` against weights prepacked for oneDNN (models/cpu_linear.py), side by side.

    .venv/bin/python scripts/cpu_linear.py [float32|bfloat16] [threads]

Loads the embedded default target twice (one copy prepacked) and times, interleaved, the forwards a server
runs: a 1-token step, an 8-position verify, one batched step of 8 requests (one token each, 200-token
contexts) and a 60-token prefill. Prints the median of each and the largest logit difference.
"""
import statistics
import sys
import time

import torch

from foresight.models.cpu_linear import prepack_linears
from foresight.models.loading import load_target, resolve_target
from foresight.target_worker.runner import TargetRunner

ROUNDS = 14


def contexts(runner: TargetRunner, count: int) -> list:
    caches = []
    for b in range(count):
        cache = runner.new_cache()
        runner.prefill(cache, [100 + (7 * b + i) % 3000 for i in range(200)])  # a different context each
        caches.append(cache)
    return caches


def crop(caches: list, n: int) -> None:
    for cache in caches:
        cache.crop(-n)


FORWARDS = {
    "1-token step": lambda r, cs: (r.verify(cs[0], 5, []), crop(cs[:1], 1)),
    "8-position verify": lambda r, cs: (r.verify(cs[0], 5, [6, 7, 8, 9, 10, 11, 12]), crop(cs[:1], 8)),
    "8 requests, 1 token each": lambda r, cs: (r.verify_batch(cs, [[5]] * 8), crop(cs, 1)),
    "60-token prefill": lambda r, cs: r.prefill(r.new_cache(), list(range(300, 360))),
}


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    plain = load_target(resolve_target(None), dtype, "cpu")
    packed = load_target(resolve_target(None), dtype, "cpu")
    prepack_linears(packed)
    runners = {"plain": TargetRunner(plain), "prepacked": TargetRunner(packed)}
    caches = {name: contexts(r, 8) for name, r in runners.items()}
    for label, forward in FORWARDS.items():
        times = {name: [] for name in runners}
        for i in range(ROUNDS):
            order = list(runners) if i % 2 else list(runners)[::-1]
            for name in order:
                t0 = time.perf_counter()
                forward(runners[name], caches[name])
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        print(f"{dtype} {label}: plain {ms['plain']:.1f} ms, prepacked {ms['prepacked']:.1f} ms "
              f"({ms['plain'] / ms['prepacked']:.2f}x)", flush=True)
    a = runners["plain"].verify(caches["plain"][0], 5, [6, 7, 8]).logits
    b = runners["prepacked"].verify(caches["prepacked"][0], 5, [6, 7, 8]).logits
    print(f"largest logit difference {(a - b).abs().max().item():.2e}, same argmax: "
          f"{torch.equal(a.argmax(-1), b.argmax(-1))}")


if __name__ == "__main__":
    main()
