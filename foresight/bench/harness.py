"""`foresight bench`: every mode on the same prompts, in one run, with the same process layout as serve.

Modes are interleaved prompt by prompt (ar, sync, ... for prompt 1, then prompt 2, ...) so that
slow drift of a noisy machine hits every mode alike; ratios are then taken within the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import MODES, EngineConfig
from ..protocol.messages import GenerateRequest
from ..server.engine_client import EngineClient
from ..server.openai_schemas import ChatCompletionRequest, CompletionRequest
from ..server.serving import RequestRunner
from ..target_worker.loading import load_tokenizer, resolve_dtype, resolve_target
from .prompts import load_prompts
from .report import write_chart


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", required=True, help="JSONL file ({'prompt'} or {'messages'} per line) or 'humaneval'")
    g.add_argument("--modes", default="ar,sync", help="comma-separated subset of ar,sync,pipelined")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--out", default="bench-report.json")


@dataclass
class ModeTally:
    output_tokens: int = 0
    wall_s: float = 0.0
    rounds: int = 0  # verification rounds (prefill excluded)
    committed: int = 0  # tokens committed by those rounds
    lookups: int = 0
    hits: int = 0
    exposed_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, mode: str, ar_outputs: list[list[int]] | None) -> dict:
        ms = [1e3 * x for x in self.exposed_s]
        match = None
        if ar_outputs is not None:
            match = sum(a == b for a, b in zip(ar_outputs, self.outputs)) / max(len(self.outputs), 1)
        return {
            "tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else None,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "rounds": self.rounds,
            "tau": self.committed / self.rounds if self.rounds else None,
            "hit_rate": self.hits / self.lookups if self.lookups else None,
            "exposed_draft_ms_mean": statistics.fmean(ms) if ms and mode != "ar" else None,
            "exposed_draft_ms_p50": _quantile(ms, 0.5) if mode != "ar" else None,
            "exposed_draft_ms_p90": _quantile(ms, 0.9) if mode != "ar" else None,
            "verify_ms_mean": 1e3 * statistics.fmean(self.verify_s) if self.verify_s else None,
            "outputs_match_ar": match,
        }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_one(engine: EngineClient, request: GenerateRequest, tally: ModeTally) -> None:
    t0 = time.perf_counter()
    tokens: list[int] = []
    async for out in engine.generate(request):
        tokens.extend(out.token_ids)
        for stats in out.rounds:
            tally.rounds += 1
            tally.committed += stats.accepted + 1
            tally.verify_s.append(stats.verify_s)
            if stats.exposed_draft_s is not None:
                tally.exposed_s.append(stats.exposed_draft_s)
            if stats.cache_hit is not None:
                tally.lookups += 1
                tally.hits += int(stats.cache_hit)
    tally.wall_s += time.perf_counter() - t0
    tally.output_tokens += len(tokens)
    tally.outputs.append(tokens)


def build_requests(runner: RequestRunner, items: list[dict], args: argparse.Namespace) -> list[GenerateRequest]:
    requests = []
    for i, item in enumerate(items):
        common = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + i)
        body = ChatCompletionRequest(messages=item["messages"], **common) if "messages" in item \
            else CompletionRequest(prompt=item["prompt"], **common)
        prompt_ids, param = runner.prompt_ids(body)
        requests.append(runner.build(body, prompt_ids, param))
    return requests


async def bench(args: argparse.Namespace, cfg: EngineConfig) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"foresight bench: unknown mode(s) {bad}; choose from {MODES}")
    items = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(resolve_target(cfg.target))
    engine = EngineClient(cfg)
    await engine.start()
    try:
        runner = RequestRunner(engine, tokenizer, "bench", engine.target_info()["max_model_len"])
        requests = build_requests(runner, items, args)
        tallies = {m: ModeTally() for m in modes}
        await run_one(engine, _with_mode(requests[0], modes[0], "warmup"), ModeTally())
        for i, request in enumerate(requests):
            for mode in modes:
                await run_one(engine, _with_mode(request, mode, f"{mode}-{i}"), tallies[mode])
            print(f"[bench] prompt {i + 1}/{len(requests)} done", flush=True)
    finally:
        await engine.stop()
    ar = tallies["ar"].outputs if "ar" in tallies else None
    summary = {m: t.summary(m, ar) for m, t in tallies.items()}
    return {
        "model": str(cfg.target or "SmolLM2-135M-Instruct (embedded default)"),
        "drafter": engine.drafter_info().get("proposer", cfg.drafter),
        "machine": machine_info(cfg),
        "settings": {"prompts": args.prompts, "n_prompts": len(requests), "temperature": args.temperature,
                     "max_tokens": args.max_tokens, "block_size": cfg.block_size, "verification": cfg.verification,
                     "nucleus_threshold": cfg.nucleus_threshold, "modes": modes, "seed": args.seed},
        "modes": summary,
        "ratios": ratios(summary),
    }


def _with_mode(request: GenerateRequest, mode: str, tag: str) -> GenerateRequest:
    return GenerateRequest(req_id=f"bench-{tag}", prompt_ids=request.prompt_ids, max_tokens=request.max_tokens,
                           sampling=request.sampling, stop_token_ids=request.stop_token_ids,
                           ignore_eos=request.ignore_eos, mode=mode)


def ratios(summary: dict) -> dict:
    def r(a: str, b: str):
        ta = summary.get(a, {}).get("tokens_per_s")
        tb = summary.get(b, {}).get("tokens_per_s")
        return ta / tb if ta and tb else None

    return {"sync_vs_ar": r("sync", "ar"), "pipelined_vs_sync": r("pipelined", "sync"),
            "pipelined_vs_ar": r("pipelined", "ar")}


def machine_info(cfg: EngineConfig) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "target_device": cfg.target_device, "drafter_device": cfg.drafter_device,
            "target_threads": cfg.target_threads, "drafter_threads": cfg.drafter_threads,
            "dtype": str(resolve_dtype(cfg.dtype, cfg.target_device)).replace("torch.", ""),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def run_bench(args: argparse.Namespace, cfg: EngineConfig) -> int:
    report = asyncio.run(bench(args, cfg))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    write_chart(report, out.with_suffix(".png"))
    print(json.dumps({"modes": report["modes"], "ratios": report["ratios"]}, indent=2))
    print(f"[bench] report: {out} (chart {out.with_suffix('.png')})")
    return 0
