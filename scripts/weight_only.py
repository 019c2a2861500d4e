"""Weight-only quantized targets against the dense one (`--quantization int4|int8` vs `none`), side by side.

    .venv/bin/python scripts/weight_only.py [threads] [int4,int8]

Loads the embedded default in bf16 once per setting (`none`, and each quantization named: int4 = the GGUF's own
4-bit weights, int8 = per-channel 8-bit quantized at load; models/weight_only.py), then times, interleaved:
(1) the 210 linears of the decoder layers alone at 1..64 rows, each kernel against the prepacked dense copy of
its own weights (where INT4_MAX_ROWS and INT8_MAX_ROWS come from); (2) the forwards a server runs: a 1-token step,
an 8-position verify, one batched step of 8 requests and a 60-token prefill. Prints medians in ms.
"""
import statistics
import sys
import time

import torch

from foresight.models.quantization import apply_quantization
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.weight_only import weight_only_layers
from foresight.models.loading import load_target, resolve_target
from foresight.target_worker.runner import TargetRunner

ROUNDS = 12
FORWARDS = {
    "1-token step": lambda r, cs: (r.verify(cs[0], 5, []), cs[0].crop(-1)),
    "8-position verify": lambda r, cs: (r.verify(cs[0], 5, [6, 7, 8, 9, 10, 11, 12]), cs[0].crop(-8)),
    "8 requests, 1 token each": lambda r, cs: (r.verify_batch(cs, [[5]] * 8), [c.crop(-1) for c in cs]),
    "60-token prefill": lambda r, cs: r.prefill(r.new_cache(), list(range(300, 360))),
}


def served(quantization: str):
    path = resolve_target(None)
    model = load_target(path, torch.bfloat16, "cpu")
    apply_quantization(model, quantization, path, "cpu", quantization)
    use_cpu_linears(model, "auto", "cpu", quantization)
    return model


def median_ms(fn, rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def linears_alone(name: str, model) -> None:
    layers = weight_only_layers(model)
    for rows in (1, 2, 4, 8, 16, 64):
        xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in {m.in_features for m in layers}}
        kernel = median_ms(lambda: [m.kernel(xs[m.in_features]) for m in layers], 7)
        dense = median_ms(lambda: [m.dense_forward(xs[m.in_features]) for m in layers], 7)
        print(f"{len(layers)} linears, {rows:>2} rows: {name} {kernel:6.2f} ms  dense {dense:6.2f} ms  "
              f"{name} {dense / kernel:.2f}x")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["int4"]
    models = {"none": served("none")} | {kind: served(kind) for kind in kinds}
    for kind in kinds:
        linears_alone(kind, models[kind])
    runners = {name: TargetRunner(model) for name, model in models.items()}
    caches = {}
    for name, runner in runners.items():
        caches[name] = [runner.new_cache() for _ in range(8)]
        for b, cache in enumerate(caches[name]):
            runner.prefill(cache, [100 + (7 * b + i) % 3000 for i in range(200)])
    for label, forward in FORWARDS.items():
        times = {name: [] for name in runners}
        for i in range(ROUNDS):
            for name in (list(runners) if i % 2 else list(runners)[::-1]):  # alternate the order
                t0 = time.perf_counter()
                forward(runners[name], caches[name])
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        print(f"{label:>26}: " + "  ".join(f"{name} {ms[name]:6.2f} ms ({ms['none'] / ms[name]:.2f}x)"
                                            for name in runners))


if __name__ == "__main__":
    main()
