"""Offline replay of foresight outcome selection (the shape of JetSpec++ Tables 10-11).

Speculative decoding with the real target, one request at a time (`eval_drafter.speculate`,
T = 0 unless --temperature). Before each verification the foresight drafter predicts the block's
states and selects outcomes exactly as it does in pipelined serving (`ForesightDrafter.select`: the
decoder's greedy path first, then the Eq. 6 scores); after it, the realised outcome (k, a) is looked up
among the first B selected, for every B asked. This isolates what the adapter and the decoder know from
the serving budget and timing: the bench's hit rate can only be lower (the budget may draft fewer
outcomes than the cache size).

With a calibration (`--calibration`, default the one shipped beside the adapter) every round is ranked by
both rules, the decoder's Eq. 6 scores and the calibrated ones (appendix B.1), on the same rounds.
`--temperature 1` replays sampled verification (the request's seed per prompt).

Reported per decoder depth (`--decoder-layers`; 0 = the draft model's own scores, no adapter or decoder):
hit rate at each B, the decoder's top-1 agreement with the target's token after the anchor (row 0: the
outcome of every round whose first draft fails), tau of the replayed rounds, the median predict time
(adapter + decoder, one thread unless --threads) and the mean verify time. `recommended` picks the depth to
serve from those measurements (`recommend_depth`); `--record` writes it into the adapter's config.json
(`decoder_layers`), the depth the server then serves unless `--decoder-layers` says otherwise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..models.loading import resolve_target
from ..target_worker.runner import TargetRunner
from ..target_worker.steps import eos_ids
from .eval_drafter import _ints, speculate


def replay(runner: TargetRunner, drafter, prompt: list[int], max_tokens: int, block_size: int,
           eos: list[int], cache_sizes: list[int], temperature: float = 0.0, seed: int = 0) -> dict:
    """One request; per round the realised outcome's place among the selected outcomes, by the
    uncalibrated Eq. 6 rule and (when the drafter has a calibration) by the calibrated one."""
    rules = ("eq6", "calibrated") if drafter.calibration is not None else ("eq6",)
    hits = {rule: {b: 0 for b in cache_sizes} for rule in rules}
    tally = {"rounds": 0, "committed": 0, "anchor_agree": 0, "predict_s": []}

    def score(ctx, block, result, verdict) -> None:
        draft = block.tokens
        t0 = time.perf_counter()
        _, logits, _ = drafter.predict(ctx, draft)  # [gamma+1, vocab]
        tally["predict_s"].append(time.perf_counter() - t0)
        for rule in rules:
            selected = drafter.select(logits, draft, max(cache_sizes), temperature, confidence=block.confidence,
                                      calibrated=rule == "calibrated")
            realised = [i for i, o in enumerate(selected) if (o.k, o.a) == (verdict.accepted, verdict.token)]
            for b in cache_sizes:
                hits[rule][b] += bool(realised and realised[0] < b)
        tally["anchor_agree"] += int(logits[0].argmax()) == int(result.logits[0].argmax())
        tally["rounds"] += 1
        tally["committed"] += verdict.accepted + 1

    run = speculate(runner, drafter, prompt, max_tokens, temperature, block_size, seed, eos, on_verified=score)
    return {**tally, "hits": hits, "verify_s": run["verify_s"], "verifies": len(run["accepted"])}


def recommend_depth(rows: list[dict], cache_size: int) -> dict:
    """The decoder depth to serve: the best hit rate at `cache_size` among the depths whose prediction fits
    in the replay's verify time, else the cheapest prediction. That is the serving budget's rule
    (`budget.plan_round`): foresight has the verify time, the prediction comes first and the outcomes are
    drafted in what it leaves (fewer of them, fewer passes, when little is left). Both times are measured
    here, on this machine and thread count, at the replay's block size."""
    key = str(cache_size)
    fits = [r for r in rows if r["predict_ms_p50"] < r["verify_ms_mean"]]
    if fits:
        best = max(fits, key=lambda r: r["hit_rate"].get(key, 0.0))
        why = f"best hit rate at B={cache_size} among the depths predicting within the verify time"
    else:
        best = min(rows, key=lambda r: r["predict_ms_p50"])
        why = "no depth predicts within the verify time: the cheapest"
    return {"decoder_layers": best["decoder_layers"], "cache_size": cache_size, "why": why}


def record_depth(adapter_path: Path, recommended: dict, settings: dict) -> None:
    """Write the recommended depth into the adapter checkpoint's config.json (`decoder_layers`), with what it
    was measured on (`extra.eval_foresight`); the weights are untouched."""
    from ..models.adapter import AdapterConfig

    config = AdapterConfig.read(adapter_path)
    config.decoder_layers = int(recommended["decoder_layers"])
    config.extra = {**config.extra, "eval_foresight": {"recommended": recommended, "settings": settings}}
    config.write(adapter_path)


def load_eval_target(args: argparse.Namespace):
    """The fp32 target, the prompts (`--prompts`, `--offset`, `--limit`) as token ids, and its EOS ids."""
    from ..bench.prompts import load_prompts
    from ..models.loading import load_target, load_tokenizer, resolve_target
    from .labelling import chat_ids

    path = resolve_target(args.target)
    target = load_target(path, torch.float32, "cpu")
    tokenizer = load_tokenizer(path)
    items = load_prompts(args.prompts, args.offset + args.limit)[args.offset:]
    prompts = [chat_ids(tokenizer, item["messages"], True) if "messages" in item
               else tokenizer.encode(item["prompt"], add_special_tokens=False) for item in items]
    return target, prompts, eos_ids(target)


def eval_adapter_path(args: argparse.Namespace) -> Path:
    """The adapter checkpoint `--drafter` / `--adapter` name (where `--record` writes)."""
    from ..config import EngineConfig
    from ..drafter_worker.foresight import resolve_adapter_path
    from ..drafter_worker.jetspec_proposer import resolve_drafter_path

    cfg = EngineConfig(target=args.target, drafter=args.drafter, adapter=args.adapter)
    drafter = resolve_drafter_path(cfg)
    adapter = resolve_adapter_path(cfg, drafter) if drafter is not None else None
    if adapter is None:
        raise SystemExit(f"eval-foresight --record: no adapter checkpoint to record in (--drafter {args.drafter}, "
                         f"--adapter {args.adapter})")
    return adapter


def run_eval_foresight(args: argparse.Namespace) -> dict:
    from ..config import EngineConfig
    from ..drafter_worker.worker import make_proposer

    record_in = eval_adapter_path(args) if args.record else None  # a wrong path fails before the replay
    target, prompts, eos = load_eval_target(args)
    sizes = _ints(args.cache_sizes)
    results = []
    for depth in _ints(args.decoder_layers):
        cfg = EngineConfig(target=args.target, drafter=args.drafter, adapter=args.adapter, dtype="float32",
                           decoder_layers=depth, draft_passes=args.passes, calibration=args.calibration)
        drafter = make_proposer(cfg)
        if not getattr(drafter, "supports_foresight", False):
            raise SystemExit(f"eval-foresight: {args.drafter} has no adapter (foresight) to evaluate at depth {depth}")
        runner = TargetRunner.for_proposer(target, drafter)
        runs = [replay(runner, drafter, p, args.max_tokens, args.block_size, eos, sizes, args.temperature, i)
                for i, p in enumerate(prompts)]
        rounds = sum(r["rounds"] for r in runs)
        hit_rates = {rule: {str(b): sum(r["hits"][rule][b] for r in runs) / max(1, rounds) for b in sizes}
                     for rule in runs[0]["hits"]} if runs else {}
        dec = getattr(drafter.scorer, "decoder", None)  # None at depth 0
        row = {"decoder_layers": depth, "decoder_input_index": dec.input_index if dec else None, "rounds": rounds,
               "tau": sum(r["committed"] for r in runs) / max(1, rounds),
               "hit_rate": hit_rates.get("eq6", {}), "hit_rate_calibrated": hit_rates.get("calibrated"),
               "anchor_agreement": sum(r["anchor_agree"] for r in runs) / max(1, rounds),
               "predict_ms_p50": 1e3 * statistics.median([s for r in runs for s in r["predict_s"]] or [0.0]),
               "verify_ms_mean": 1e3 * sum(r["verify_s"] for r in runs) / max(1, sum(r["verifies"] for r in runs))}
        results.append(row)
        for rule, rates in hit_rates.items():
            hits = " ".join(f"B{b}={rates[str(b)]:.3f}" for b in sizes)
            print(f"[eval-foresight] decoder {depth} layers (input index {row['decoder_input_index']}), {rule}: "
                  f"{hits}", flush=True)
        print(f"[eval-foresight] anchor agreement {row['anchor_agreement']:.2f}, tau {row['tau']:.3f}, {rounds} "
              f"rounds, predict {row['predict_ms_p50']:.1f} ms, verify {row['verify_ms_mean']:.1f} ms", flush=True)
    recommended = recommend_depth(results, min(sizes, key=lambda b: abs(b - args.serve_cache_size)))
    print(f"[eval-foresight] recommended decoder depth: {recommended['decoder_layers']} ({recommended['why']})",
          flush=True)
    settings = {"prompts": args.prompts, "offset": args.offset, "limit": args.limit, "max_tokens": args.max_tokens,
                "block_size": args.block_size, "passes": args.passes, "temperature": args.temperature,
                "threads": args.threads, "dtype": "float32"}
    report = {"target": str(resolve_target(args.target)), "drafter": args.drafter, "adapter": args.adapter,
              "calibration": args.calibration, "settings": settings, "results": results, "recommended": recommended}
    if record_in is not None:
        record_depth(record_in, recommended, settings)
        report["recorded_in"] = str(record_in)
        print(f"[eval-foresight] recorded decoder_layers={recommended['decoder_layers']} in {record_in}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report
