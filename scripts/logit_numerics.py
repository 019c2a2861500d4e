"""Flip rate and step cost of the target's logit precision (bf16 LM head vs the fp32 head).

For each prompt: greedy-decode N tokens with 1-token steps (as mode `ar` does), then feed the same
sequence again in verify-shaped forwards of `--block` positions (as `sync` does) and count the positions
whose argmax differs; for each flip, the top-2 logit margin of the 1-token step. Then the time of a
1-token step and of a `--block`-token forward on a ~200-token cache per logit precision, and (bf16/fp16)
the cost of the head alone. Usage:

    .venv/bin/python scripts/logit_numerics.py --dtype bfloat16 --prompts 8 --tokens 48 --out F.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from foresight.bench.prompts import humaneval_prompts
from foresight.models.loading import load_target, load_tokenizer, resolve_target
from foresight.target_worker.logit_head import Fp32LogitHead
from foresight.target_worker.runner import TargetRunner


def decode_steps(runner, prompt, n):
    cache = runner.new_cache()
    logits = runner.prefill(cache, prompt).logits[-1]
    out, margins = [], []
    for _ in range(n):
        top = torch.topk(logits, 2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        logits = runner.forward(cache, [out[-1]]).logits[-1]
    return out, margins


def verify_argmax(runner, prompt, tokens, block):
    """argmax after each of tokens[:-1]... computed in forwards of `block` positions."""
    cache = runner.new_cache()
    first = runner.prefill(cache, prompt).logits[-1]
    got = [int(first.argmax())]
    i = 0
    while len(got) < len(tokens):
        chunk = tokens[i:i + block]
        rows = runner.forward(cache, chunk).logits  # [len(chunk), vocab]
        got += rows.argmax(-1).tolist()
        i += len(chunk)
    return got[:len(tokens)]


def time_forward(runner, context, n_new, reps=10):
    cache = runner.new_cache()
    runner.prefill(cache, context)
    base = cache.get_seq_length()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward(cache, context[:n_new])
        times.append(time.perf_counter() - t0)
        cache.crop(-n_new)
        assert cache.get_seq_length() == base
    times.sort()
    return 1e3 * times[len(times) // 2]


def median_ms(fn, reps=30) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


@torch.inference_mode()
def head_costs(model, lengths=(1, 8, 16)) -> dict:
    """The head alone on the same captured hidden states: the model's, fp32-top's extra, the full fp32 head."""
    head = Fp32LogitHead(model)
    lm = model.get_output_embeddings()
    ids = torch.randint(0, lm.weight.shape[0], (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    out = {}
    for n in lengths:
        model.model(ids[:, :n])
        hidden = head._captured  # [1, n, hidden], the last layer's output
        low = lm(model.model.norm(hidden))[0]  # [n, vocab]

        def refine():
            head._captured = hidden
            head.refine(low)

        def full():
            head._captured = hidden
            head.logits(n)

        out[n] = {"model_head_ms": median_ms(lambda: lm(model.model.norm(hidden))),
                  "fp32_top_extra_ms": median_ms(refine), "fp32_head_ms": median_ms(full)}
        print(f"head, {n} positions: {json.dumps(out[n])}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_target(None)
    tok = load_tokenizer(path)
    model = load_target(path, getattr(torch, args.dtype), "cpu")
    prompts = [tok.apply_chat_template(p["messages"], add_generation_prompt=True)
               for p in humaneval_prompts()[:args.prompts]]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    report = {"dtype": args.dtype, "threads": args.threads, "block": args.block, "variants": {}}
    for name in ("model", "fp32", "fp32-top"):
        runner = TargetRunner(model, logits=name)
        flips, positions, flip_margins, near = 0, 0, [], 0
        for prompt in prompts:
            steps, margins = decode_steps(runner, prompt, args.tokens)
            ver = verify_argmax(runner, prompt, steps, args.block)
            for a, b, m in zip(steps, ver, margins):
                positions += 1
                near += m < 0.1
                if a != b:
                    flips += 1
                    flip_margins.append(round(m, 5))
        context = prompts[0] * (200 // len(prompts[0]) + 1)
        report["variants"][name] = {
            "positions": positions, "flips": flips, "flip_margins": sorted(flip_margins),
            "positions_margin_below_0.1": near,
            "step_ms_1": time_forward(runner, context[:200], 1),
            f"step_ms_{args.block}": time_forward(runner, context[:200], args.block),
        }
        print(name, json.dumps(report["variants"][name]), flush=True)
    if next(model.parameters()).dtype != torch.float32:
        report["head_costs"] = head_costs(model)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
