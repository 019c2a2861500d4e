"""The int8 head for rows decided by their argmax (target_worker/argmax_head.py) on the embedded default: its bound
against the true error, the entries its window refines, the argmax against the fp32 head's, and the step time.

    .venv/bin/python scripts/argmax_head.py [threads] [prompts] [tokens]

Loads the target as the server does (bf16 where the CPU has it, `--quantization auto`, `--cpu-linear auto`) with its
compiled steps (the server's packages: one request's buckets, split for `threads`, default 2), greedy-decodes `tokens`
(default 64) after each of the first `prompts` (default 6) chat-set prompts with one-token steps through the int8
head, and for every step compares its logits with the full fp32 head's: the largest error, the largest error over
its bound, the entries refined, whether the argmax is the fp32 head's. Then the median time of a one-token step
with the bf16 head and with the int8 head, alternating, on the same cache.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from foresight.bench.prompts import load_prompts
from foresight.models.compiled_step import CompiledStep, batch_ranges, step_buckets
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.int4_linear import serves_int4
from foresight.models.loading import cache_root, load_target, load_tokenizer, resolve_dtype, resolve_target
from foresight.models.quantization import apply_quantization
from foresight.target_worker.packed_step import packed_attention
from foresight.target_worker.runner import TargetRunner
from foresight.protocol.messages import HiddenLayout
from foresight.training.labelling import chat_ids

from batch_step import BLOCK, SERVED_LAYERS


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    torch.set_num_threads(threads)
    path = resolve_target(None)
    dtype = resolve_dtype("auto", "cpu")  # the server's `--dtype auto`
    model = load_target(path, dtype, "cpu")
    apply_quantization(model, "auto", path, "cpu", "target")
    use_cpu_linears(model, "auto", "cpu", "target")
    compiled = CompiledStep(model, SERVED_LAYERS, step_buckets(BLOCK), cache_root() / "compiled",
                            autotune=serves_int4(model), attention=packed_attention, threads=threads,
                            batch_ranges=batch_ranges(model), block_tokens=BLOCK, chunk_tokens=(BLOCK + 1, 256))
    compiled.build()
    runner = TargetRunner(model, HiddenLayout(SERVED_LAYERS, model.config.hidden_size), compiled=compiled)
    if runner.argmax_head is None:
        sys.exit(f"no int8 head: the target runs in {dtype} (it serves low-precision targets only)")
    head, fp32 = runner.argmax_head, runner.head.weight  # fp32 [vocab, hidden]
    measured = []
    logits_of = head.logits

    def checked(low, normed):
        logits, columns = logits_of(low, normed)
        error = (normed @ fp32.T - logits).abs()  # [1, vocab]
        measured.append((float(error.max()), float((error / head.bounds(logits, low, normed)).max()),
                         columns.shape[1]))
        return logits, columns

    head.logits = checked
    tokenizer = load_tokenizer(Path(path))
    agree = steps = 0
    for item in load_prompts("chat", prompts):
        cache = runner.new_cache()
        token = int(runner.prefill(cache, chat_ids(tokenizer, item["messages"], True)).logits[-1].argmax())
        for _ in range(tokens):
            result = runner.verify(cache, token, [], argmax_only=True)
            token = int(result.logits[-1].argmax())
            agree += token == int((fp32 @ result.head_input[0]).argmax())
            steps += 1
    head.logits = logits_of
    errors, ratios, refined = zip(*measured)
    print(f"{steps} steps ({str(dtype).removeprefix('torch.')}, {threads} threads): largest error {max(errors):.3f} "
          f"logits, largest error / bound {max(ratios):.3f}, entries refined median {statistics.median(refined):.0f} "
          f"max {max(refined)}, argmax = the fp32 head's in {agree} of {steps}")
    times = {False: [], True: []}
    for _ in range(3):
        for argmax_only in (False, True):
            for _ in range(40):
                t0 = time.perf_counter()
                result = runner.verify(cache, token, [], argmax_only=argmax_only)
                times[argmax_only].append(time.perf_counter() - t0)
                token = int(result.logits[-1].argmax())
    bf16, int8 = (1e3 * statistics.median(times[flag]) for flag in (False, True))
    print(f"one-token step: bf16 head {bf16:.2f} ms, int8 head {int8:.2f} ms ({bf16 / int8:.2f}x)")


if __name__ == "__main__":
    main()
