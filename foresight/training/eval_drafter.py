"""Offline evaluation of a drafter: real speculative decoding with the real target, one request at a time.

The loop is the round of the workers without the sockets: prefill, then (propose -> verify -> roll back ->
absorb) until max_tokens or EOS. Reports tau (committed tokens per verification round) for every
temperature x block size x Jacobi passes J, and checks at T=0 that the output equals the target's plain
greedy decoding; where it differs, the target's top-2 logit gap at the first divergence is reported
(a near-tie flipped by the rounding difference between a block verify and a 1-token step).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..drafter_worker.ngram import NgramProposer
from ..drafter_worker.proposer import Draft, DraftContext
from ..target_worker.runner import TargetRunner
from ..spec.verification import verify
from ..target_worker.steps import drafter_seed, eos_ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def greedy_reference(runner: TargetRunner, prompt: list[int], max_tokens: int, eos: list[int]):
    """Plain greedy decoding, one token per forward; also the top-2 logit gap at each step."""
    cache = runner.new_cache()
    logits = runner.prefill(cache, prompt).logits[-1]
    out, gaps = [], []
    while True:
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        out.append(int(logits.argmax()))
        if len(out) >= max_tokens or out[-1] in eos:
            return out, gaps
        logits = runner.verify(cache, out[-1], []).logits[-1]


def speculate(runner: TargetRunner, proposer, prompt: list[int], max_tokens: int, temperature: float,
              block_size: int, seed: int, eos: list[int], on_verified=None) -> dict:
    """One request through the speculative round loop (sync mode). `on_verified(ctx, block, result,
    verdict)` is called after each verification of a non-empty block (a `Draft`), before the drafter
    absorbs it."""
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    cache = runner.new_cache()
    res = runner.prefill(cache, prompt)
    first = verify(res.logits, [], temperature=temperature, generator=gen).token
    ctx = DraftContext(req_id="eval", tokens=list(prompt), seed=drafter_seed(seed),
                       hidden=[res.hidden] if res.hidden is not None else [],
                       linear_states=runner.linear_states(cache, len(prompt)))
    ctx.absorb(0, first, None)
    proposer.add_request(ctx)  # its state lives in `ctx`, and goes with it
    return _round_loop(runner, proposer, ctx, cache, gen, first, max_tokens, temperature, block_size, eos,
                       on_verified)


def _round_loop(runner: TargetRunner, proposer, ctx: DraftContext, cache, gen: torch.Generator, first: int,
                max_tokens: int, temperature: float, block_size: int, eos: list[int], on_verified) -> dict:
    out, accepted, draft_s, verify_s = [first], [], 0.0, 0.0
    while len(out) < max_tokens and out[-1] not in eos:
        n = min(block_size - 1, max_tokens - len(out) - 1)
        t0 = time.perf_counter()
        block = proposer.propose(ctx, n).prefix(n) if n > 0 else Draft()
        draft = block.tokens
        t1 = time.perf_counter()
        result = runner.verify(cache, ctx.tokens[-1], draft)
        verdict = verify(result.logits, draft, temperature=temperature, generator=gen)
        runner.rollback(cache, len(draft) - verdict.accepted, result)
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0
        if on_verified is not None and draft:
            on_verified(ctx, block, result, verdict)
        ctx.last_block = block
        hidden = result.hidden[:verdict.accepted + 1] if result.hidden is not None else None
        # Cached now: the committed tokens before the new anchor (a hybrid target's snapshot covers them).
        snapshot = runner.linear_states(cache, len(ctx.tokens) + verdict.accepted)
        ctx.absorb(verdict.accepted, verdict.token, hidden, snapshot)
        proposer.commit(ctx)
        accepted.append(verdict.accepted)
        for tok in draft[:verdict.accepted] + [verdict.token]:
            out.append(tok)
            if tok in eos or len(out) >= max_tokens:
                break
    return {"tokens": out, "accepted": accepted, "draft_s": draft_s, "verify_s": verify_s}


def load_proposer(spec: str, target, device: str, dtype: torch.dtype):
    """`dtype`: the drafter's (resolve_drafter_dtype, as the drafter worker picks it)."""
    if spec == "ngram":
        return NgramProposer()
    from ..drafter_worker.jetspec_proposer import JetSpecProposer

    return JetSpecProposer.load(spec, target, device, dtype)


def run_eval(args: argparse.Namespace) -> dict:
    from ..bench.prompts import load_prompts
    from ..models.loading import (load_target, load_tokenizer, resolve_drafter_dtype, resolve_dtype,
                                         resolve_target)
    from .labelling import chat_ids

    path = resolve_target(args.target)
    dtype = resolve_dtype(args.dtype, args.device)
    target = load_target(path, dtype, args.device)
    tokenizer = load_tokenizer(path)
    prompts = [chat_ids(tokenizer, item["messages"], True) if "messages" in item
               else tokenizer.encode(item["prompt"], add_special_tokens=False) for item in load_prompts(args.prompts, args.limit)]
    drafter_dtype = resolve_drafter_dtype(args.drafter_dtype, args.dtype, args.device)
    proposer = load_proposer(args.drafter, target, args.device, drafter_dtype)
    runner = TargetRunner.for_proposer(target, proposer)
    eos = eos_ids(target)
    temps, sizes, passes = _floats(args.temperatures), _ints(args.block_sizes), _ints(args.passes)
    if not hasattr(proposer, "passes"):
        passes = [0]
    refs = [greedy_reference(runner, p, args.max_tokens, eos) for p in prompts] if 0.0 in temps else None
    results = []
    for temp in temps:
        for size in sizes:
            for j in passes:
                if hasattr(proposer, "passes"):
                    proposer.passes = j
                results.append(_run_config(runner, proposer, prompts, refs, args, temp, size, j, eos))
                r = results[-1]
                print(f"[eval] T={temp} block={size} J{j}: tau={r['tau']:.3f} ({r['rounds']} rounds, "
                      f"draft {r['draft_ms_mean']:.1f} ms, verify {r['verify_ms_mean']:.1f} ms)"
                      + (f" greedy_match={r['greedy_match']:.2f}" if r["greedy_match"] is not None else ""), flush=True)
    report = {"target": str(path), "drafter": args.drafter, "dtype": str(dtype).replace("torch.", ""),
              "drafter_dtype": str(drafter_dtype).replace("torch.", ""),
              "settings": {"prompts": args.prompts, "limit": args.limit, "max_tokens": args.max_tokens,
                           "threads": args.threads, "device": args.device, "seed": args.seed},
              "results": results, "summary": _summary(results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def _run_config(runner, proposer, prompts, refs, args, temp, size, j, eos) -> dict:
    rounds = committed = 0
    draft_s = verify_s = 0.0
    matches, mismatches = 0, []
    per_prompt = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        r = speculate(runner, proposer, prompt, args.max_tokens, temp, size, args.seed + i, eos)
        rounds += len(r["accepted"])
        committed += sum(a + 1 for a in r["accepted"])
        draft_s += r["draft_s"]
        verify_s += r["verify_s"]
        per_prompt.append(sum(a + 1 for a in r["accepted"]) / max(1, len(r["accepted"])))
        if temp == 0.0 and refs is not None:
            ref, gaps = refs[i]
            if r["tokens"] == ref:
                matches += 1
            else:
                k = next((x for x, (a, b) in enumerate(zip(r["tokens"], ref)) if a != b), min(len(ref), len(r["tokens"])))
                mismatches.append({"prompt": i, "first_divergence": k, "top2_gap": gaps[k] if k < len(gaps) else None})
    wall = time.perf_counter() - t0
    return {"temperature": temp, "block_size": size, "passes": j, "tau": committed / max(1, rounds),
            "rounds": rounds, "committed": committed, "tau_per_prompt": per_prompt,
            "draft_ms_mean": 1000 * draft_s / max(1, rounds), "verify_ms_mean": 1000 * verify_s / max(1, rounds),
            "tokens_per_s": committed / wall if wall else None,
            "greedy_match": matches / len(prompts) if temp == 0.0 and prompts else None, "mismatches": mismatches}


def _summary(results: list[dict]) -> dict:
    """tau by "T=<t> block=<b>" and J, plus the best J per cell."""
    table: dict[str, dict] = {}
    for r in results:
        cell = table.setdefault(f"T={r['temperature']:g} block={r['block_size']}", {})
        cell[f"J{r['passes']}"] = round(r["tau"], 3)
    for cell in table.values():
        cell["best"] = max((k for k in cell if k.startswith("J")), key=lambda k: cell[k])
    return table
