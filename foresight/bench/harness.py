"""`foresight bench`: every mode on the same prompts, in one run, with the same process layout as serve.

Modes are interleaved prompt by prompt (ar, sync, ... for prompt 1, then prompt 2, ...) so that
slow drift of a noisy machine hits every mode alike; ratios are then taken within the run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pydantic
import torch

from ..config import ConfigError, EngineConfig
from ..protocol.kinds import Mode, Refinement
from ..protocol.messages import GenerateRequest
from ..server.engine_client import EngineClient
from ..server.openai_schemas import ChatCompletionRequest, CompletionRequest
from ..server.serving import RequestRunner
from ..models.cpu_linear import use_cpu_linears
from ..models.quantization import apply_quantization, resolve_quantization
from ..models.loading import gguf_source, load_target, load_tokenizer, resolve_dtype, resolve_target
from ..target_worker.logit_rules import LogitRules
from ..target_worker.runner import TargetRunner
from ..target_worker.steps import eos_ids
from . import numerics
from .peers import PeerGroups, open_peers, plan_peers
from .prompts import load_prompts, request_fields
from .report import write_chart


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", required=True, help="JSONL file ({'prompt'} or {'messages'} per line), 'humaneval' or 'chat'")
    g.add_argument("--modes", default="ar,sync", help="comma-separated subset of " + ",".join(Mode.values()))
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--request-fields", default="",
                   help="more request fields for every prompt, as a JSON object validated as the API validates it, "
                        "e.g. '{\"presence_penalty\": 0.5, \"logit_bias\": {\"198\": -100}}' (the modes apply them; "
                        "the peers do not)")
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--out", default="bench-report.json")
    g.add_argument("--nucleus-thresholds", default="",
                   help="also run the last speculative mode with nucleus verification at these thetas "
                        "(e.g. 0.8,0.9,0.95) and compare with exact verification")
    g.add_argument("--peers", default="",
                   help="also run these peers on the same prompts, interleaved, each with the workers' thread "
                        "count and with one thread (comma-separated; hf: transformers' generate, plain and with "
                        "prompt lookup; llamacpp: llama.cpp via xllamacpp on the target's GGUF, as shipped and "
                        "rewritten as BF16; with --concurrency: llamacpp only, its own server, at the workers' "
                        "thread count)")
    g.add_argument("--refinement-ablation", default="",
                   help="also run pipelined mode with each of these self-refinement modes (e.g. none,refresh,anchor) "
                        "and report them side by side (section 'refinement')")
    g.add_argument("--concurrency", default="",
                   help="load benchmark instead of the in-process runs: start `foresight serve` per mode (with "
                        "these engine flags) and stream from this many concurrent clients at each level, e.g. "
                        "1,4,8,16 (section 'concurrency'; docs/benchmark.md, 'Load benchmark')")
    g.add_argument("--load-requests", type=int, default=None,
                   help="load benchmark: requests per concurrency level (default: max(2 x level, prompts))")
    g.add_argument("--load-repeats", type=int, default=1,
                   help="load benchmark: runs of each level per mode, the modes' order rotated each run; "
                        "tokens/s is their median, ratios_vs_ar pairs the runs of one repeat")
    g.add_argument("--load-server-args", default="",
                   help="load benchmark: extra `foresight serve` flags, e.g. '--max-num-seqs 8 --max-waiting 4'")


@dataclass
class ModeTally:
    output_tokens: int = 0
    wall_s: float = 0.0
    rounds: int = 0  # verification rounds (prefill excluded)
    committed: int = 0  # tokens committed by those rounds
    drafted: int = 0  # draft tokens verified by those rounds
    lookups: int = 0
    hits: int = 0
    exposed_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    nucleus_extra: int = 0
    predrafted: int = 0  # blocks served from the speculation cache (pre-drafted, refined)
    passes: int = 0  # refinement passes spent on those blocks
    refreshes: int = 0  # context refreshes spent on those blocks
    strategies: dict[str, int] = field(default_factory=dict)  # rounds per strategy (mode auto's choices)
    hit_committed: int = 0  # tokens committed by rounds served from the speculation cache
    miss_committed: int = 0  # ... by rounds that looked it up and missed (a fallback draft)
    compiled: int = 0  # rounds a compiled graph verified
    known_forward: int = 0  # rounds that say how their forward ran (the target has compiled steps)

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
            "verified_drafts_mean": self.drafted / self.rounds if self.rounds else None,
            "hit_rate": self.hits / self.lookups if self.lookups else None,
            "exposed_draft_ms_mean": statistics.fmean(ms) if ms and mode != "ar" else None,
            "exposed_draft_ms_p50": _quantile(ms, 0.5) if mode != "ar" else None,
            "exposed_draft_ms_p90": _quantile(ms, 0.9) if mode != "ar" else None,
            "verify_ms_mean": 1e3 * statistics.fmean(self.verify_s) if self.verify_s else None,
            "outputs_match_ar": match,
            # the outputs' token ids, digested: equal digests across runs or builds mean equal outputs
            "outputs_sha256": hashlib.sha256(json.dumps(self.outputs).encode()).hexdigest(),
            "passes_mean": self.passes / self.predrafted if self.predrafted else None,
            "refreshes_mean": self.refreshes / self.predrafted if self.predrafted else None,
            "strategy_rounds": dict(sorted(self.strategies.items())),
            "tau_hits": self.hit_committed / self.hits if self.hits else None,
            "tau_misses": self.miss_committed / (self.lookups - self.hits) if self.lookups > self.hits else None,
            "compiled_rounds": self.compiled / self.known_forward if self.known_forward else None,
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
            tally.strategies[stats.strategy] = tally.strategies.get(stats.strategy, 0) + 1
            tally.committed += stats.accepted + 1
            tally.drafted += stats.drafted
            tally.verify_s.append(stats.verify_s)
            tally.nucleus_extra += stats.nucleus_extra
            if stats.compiled is not None:
                tally.known_forward += 1
                tally.compiled += int(stats.compiled)
            if stats.exposed_draft_s is not None:
                tally.exposed_s.append(stats.exposed_draft_s)
            if stats.cache_hit is not None:
                tally.lookups += 1
                tally.hits += int(stats.cache_hit)
                if stats.cache_hit:
                    tally.hit_committed += stats.accepted + 1
                else:
                    tally.miss_committed += stats.accepted + 1
            if stats.cache_hit:
                tally.predrafted += 1
                tally.passes += stats.passes
                tally.refreshes += stats.refreshes
    tally.wall_s += time.perf_counter() - t0
    tally.output_tokens += len(tokens)
    tally.outputs.append(tokens)


def build_requests(runner: RequestRunner, items: list[dict], args: argparse.Namespace) -> list[GenerateRequest]:
    requests = []
    fields = request_fields(getattr(args, "request_fields", ""))
    for i, item in enumerate(items):
        common = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed + i, **fields}
        try:
            body = ChatCompletionRequest(messages=item["messages"], **common) if "messages" in item \
                else CompletionRequest(prompt=item["prompt"], **common)
        except pydantic.ValidationError as exc:
            raise SystemExit(f"--request-fields: {exc}") from None
        if body.n != 1:
            raise SystemExit("--request-fields: n must be 1 (the bench times one sequence per prompt)")
        prompt_ids, param = runner.prompt_ids(body)
        requests.append(runner.build(body, prompt_ids, param))
    return requests


@dataclass(frozen=True)
class Run:
    label: str
    mode: str
    verification: str
    theta: float
    refinement: str | None = None  # None: the server's


def plan_runs(args: argparse.Namespace, cfg: EngineConfig) -> tuple[list[Run], list[Run]]:
    """The mode runs (server verification rule) and the nucleus-comparison runs."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in Mode.values()]
    if bad:
        raise ConfigError(f"modes: unknown mode(s) {bad}; choose from {', '.join(Mode.values())}")
    mode_runs = [Run(m, m, cfg.verification, cfg.nucleus_threshold) for m in modes]
    thetas = [float(t) for t in args.nucleus_thresholds.split(",") if t.strip()]
    if any(not 0 < t <= 1 for t in thetas):
        raise ConfigError("nucleus_thresholds must lie in (0, 1]")
    spec_modes = [m for m in modes if m != "ar"]
    if thetas and not spec_modes:
        raise ConfigError("nucleus_thresholds need a speculative mode (sync or pipelined) in --modes")
    nucleus_runs = []
    if thetas:
        base = spec_modes[-1]
        if cfg.verification != "exact":
            nucleus_runs.append(Run(f"{base}/exact", base, "exact", cfg.nucleus_threshold))
        nucleus_runs += [Run(f"{base}/nucleus@{t:g}", base, "nucleus", t) for t in thetas]
    return mode_runs, nucleus_runs


def refinement_runs(args: argparse.Namespace, cfg: EngineConfig) -> list[Run]:
    """One pipelined run per --refinement-ablation mode (server verification rule)."""
    values = [v.strip() for v in getattr(args, "refinement_ablation", "").split(",") if v.strip()]
    bad = [v for v in values if v not in Refinement.values()]
    if bad:
        raise ConfigError(f"refinement_ablation: unknown mode(s) {bad}; "
                          f"choose from {', '.join(Refinement.values())}")
    return [Run(f"pipelined/refinement={v}", "pipelined", cfg.verification, cfg.nucleus_threshold, v)
            for v in dict.fromkeys(values)]


@contextlib.asynccontextmanager
async def engine_session(cfg: EngineConfig, name: str):
    """The engine's worker processes for one run: yields (engine, request runner, drafter info)."""
    tokenizer = load_tokenizer(resolve_target(cfg.target))
    engine = EngineClient(cfg)
    await engine.start()
    try:
        runner = RequestRunner(engine, tokenizer, name, engine.target_info()["max_model_len"])
        yield engine, runner, dict(engine.drafter_info())  # a copy: stop() forgets it
    finally:
        await engine.stop()


async def run_interleaved(engine: EngineClient, requests: list[GenerateRequest], runs: list[Run],
                          tallies: dict[str, ModeTally], name: str, peers: PeerGroups | None = None) -> dict[str, float]:
    """Every run (then every peer) on every request, one after the other within a request, after a warm-up
    request of every run and peer on the first prompt, not counted: what a server pays once in its lifetime
    (a mode's first calls, auto's first trial of each strategy) is not what it costs per request. Returns each
    run's warm-up seconds."""
    warmup_s = {}
    for run in runs:
        warm = ModeTally()
        await run_one(engine, request_for_run(requests[0], run, "warmup"), warm)
        warmup_s[run.label] = round(warm.wall_s, 3)
    if peers is not None:
        await asyncio.to_thread(peers.warm_up, requests[0])
    for i, request in enumerate(requests):
        for run in runs:
            await run_one(engine, request_for_run(request, run, str(i)), tallies[run.label])
        if peers is not None:
            # In a thread: the api-side loop keeps reading the (idle) workers' heartbeats meanwhile.
            await asyncio.to_thread(peers.run_all, request)
        print(f"[{name}] prompt {i + 1}/{len(requests)} done", flush=True)
    return warmup_s


async def bench(args: argparse.Namespace, cfg: EngineConfig) -> dict:
    mode_runs, nucleus_runs = plan_runs(args, cfg)
    refine_runs = refinement_runs(args, cfg)
    runs = mode_runs + nucleus_runs + refine_runs
    items = load_prompts(args.prompts, args.limit)
    planned = plan_peers(getattr(args, "peers", ""), cfg)
    peers = open_peers(cfg, planned)
    async with engine_session(cfg, "bench") as (engine, runner, info):
        drafter = info.get("proposer", cfg.drafter)
        compiled = engine.target_info().get("compiled")  # what the target worker compiled at start-up
        decoder_layers = info.get("decoder_layers")  # the depth in use, resolved by the drafter
        missing = sorted({r.mode for r in runs} - {"auto"} - set(info.get("strategies", ())))
        if missing:
            raise ConfigError(f"modes: {', '.join(missing)} not offered by the drafter {drafter!r} (pipelined needs "
                              f"foresight, hybrid a draft model); it offers {', '.join(info.get('strategies', ()))}")
        requests = build_requests(runner, items, args)
        tallies = {r.label: ModeTally() for r in runs}
        warmup_s = await run_interleaved(engine, requests, runs, tallies, "bench", peers)
    ar = tallies["ar"].outputs if "ar" in tallies else None
    summary = {r.label: tallies[r.label].summary(r.mode, ar) | {"warmup_s": warmup_s[r.label]} for r in mode_runs}
    for label, fields in numerics_probe(cfg, args, requests, mode_runs, tallies).items():
        summary[label].update(fields)
    if "pipelined" in summary:
        summary["pipelined"].update(pipeline_efficiency(summary))
    report = {
        "model": str(cfg.target or "SmolLM2-135M-Instruct (embedded default)"),
        "drafter": drafter,
        "machine": machine_info(cfg) | {"compiled": compiled, "compiled_draft": info.get("compiled")},
        "settings": {"prompts": args.prompts, "n_prompts": len(requests), "temperature": args.temperature,
                     "request_fields": request_fields(getattr(args, "request_fields", "")),
                     "max_tokens": args.max_tokens, "block_size": cfg.block_size, "verification": cfg.verification,
                     "nucleus_threshold": cfg.nucleus_threshold, "modes": [r.mode for r in mode_runs],
                     "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max, "refinement": cfg.refinement,
                     "draft_passes": cfg.draft_passes, "draft_refreshes": cfg.draft_refreshes,
                     "foresight_passes": cfg.foresight_passes,
                     "foresight_budget": cfg.foresight_budget, "verify_length": cfg.verify_length,
                     "cache_size": cfg.cache_size, "decoder_layers": decoder_layers,
                     "calibration": info.get("calibration"), "seed": args.seed},
        "modes": summary,
        "ratios": ratios(summary),
    }
    if nucleus_runs:
        report["nucleus"] = nucleus_section(mode_runs, nucleus_runs, tallies)
    if refine_runs:
        report["refinement"] = refinement_section(refine_runs, tallies, ar)
    if peers is not None:
        report["peers"] = peers.section(ar, summary)
    return report


def numerics_probe(cfg: EngineConfig, args: argparse.Namespace, requests: list[GenerateRequest],
                   mode_runs: list[Run], tallies: dict) -> dict:
    """Per speculative mode: its outputs that differ from ar's, each explained by a near-tie or not
    (bench/numerics.py). Only greedy exact verification promises equality; elsewhere the fields are null."""
    spec = [r for r in mode_runs if r.mode != "ar"]
    empty = {"mismatches": None, "mismatches_near_tie": None, "mismatches_unexplained": None}
    if "ar" not in tallies or args.temperature != 0 or cfg.verification != "exact":
        return {r.label: dict(empty) for r in spec}
    differing = [r for r in spec if tallies[r.label].outputs != tallies["ar"].outputs]
    result = {r.label: numerics.summarise([]) for r in spec}
    if differing:
        dtype = resolve_dtype(cfg.dtype, cfg.target_device)
        torch.set_num_threads(cfg.target_threads)
        path = resolve_target(cfg.target)
        model = load_target(path, dtype, cfg.target_device)
        apply_quantization(model, cfg.quantization, path, cfg.target_device, "numerics probe")  # as served
        use_cpu_linears(model, cfg.cpu_linear, cfg.target_device, "numerics probe")
        runner = TargetRunner(model)
        prompts = [r.prompt_ids for r in requests]
        rules = [LogitRules.of(r.sampling, r.prompt_ids, eos_ids(model) + r.stop_token_ids) for r in requests]
        for r in differing:
            found = numerics.probe(runner, dtype, prompts, tallies["ar"].outputs, tallies[r.label].outputs, rules)
            result[r.label] = numerics.summarise(found)
    return result


def refinement_section(runs: list[Run], tallies: dict, ar_outputs: list[list[int]] | None) -> dict:
    """Per self-refinement mode (JetSpec++ Table 5): tau, hits, speed, exposed drafting, the passes and
    refreshes spent per pre-drafted block, and whether the outputs equal ar's (None without an ar run)."""
    out = {}
    for run in runs:
        t = tallies[run.label]
        s = t.summary(run.mode, ar_outputs)
        out[run.refinement] = {k: s[k] for k in ("tau", "hit_rate", "tokens_per_s", "exposed_draft_ms_mean",
                                                 "outputs_match_ar", "passes_mean", "refreshes_mean")}
    return out


def nucleus_section(mode_runs: list[Run], nucleus_runs: list[Run], tallies: dict) -> dict:
    """Each nucleus run against exact verification of the same mode: tau, speed, differing outputs."""
    base = nucleus_runs[-1].mode
    exact = next(r for r in nucleus_runs + mode_runs if r.mode == base and r.verification == "exact")
    ref = tallies[exact.label]
    ref_tps = ref.output_tokens / ref.wall_s if ref.wall_s else None
    out = {}
    for run in [exact] + [r for r in nucleus_runs if r.verification == "nucleus"]:
        t = tallies[run.label]
        s = t.summary(run.mode, None)
        key = "exact" if run.verification == "exact" else f"nucleus@{run.theta:g}"
        out[key] = {
            "mode": run.mode,
            "verification": run.verification,
            "theta": run.theta if run.verification == "nucleus" else None,
            "tau": s["tau"],
            "tokens_per_s": s["tokens_per_s"],
            "nucleus_extra_accepted_tokens": t.nucleus_extra,
            "outputs_differ_from_exact": sum(a != b for a, b in zip(ref.outputs, t.outputs)) / max(len(t.outputs), 1),
            "speed_vs_exact": s["tokens_per_s"] / ref_tps if s["tokens_per_s"] and ref_tps else None,
        }
    return out


def request_for_run(request: GenerateRequest, run: Run, tag: str) -> GenerateRequest:
    sampling = dataclasses.replace(request.sampling, verification=run.verification, nucleus_threshold=run.theta)
    return GenerateRequest(req_id=f"bench-{run.label}-{tag}", prompt_ids=request.prompt_ids,
                           max_tokens=request.max_tokens, sampling=sampling, stop_token_ids=request.stop_token_ids,
                           ignore_eos=request.ignore_eos, mode=run.mode, refinement=run.refinement)


def ratios(summary: dict) -> dict:
    def r(a: str, b: str):
        ta = summary.get(a, {}).get("tokens_per_s")
        tb = summary.get(b, {}).get("tokens_per_s")
        return ta / tb if ta and tb else None

    out = {"sync_vs_ar": r("sync", "ar"), "pipelined_vs_sync": r("pipelined", "sync"),
           "pipelined_vs_ar": r("pipelined", "ar"), "ngram_vs_ar": r("ngram", "ar"), "hybrid_vs_ar": r("hybrid", "ar"),
           "auto_vs_ar": r("auto", "ar")}
    # auto's promise: never slower than the better of plain decoding and prompt lookup
    baselines = [m for m in ("ar", "ngram") if summary.get(m, {}).get("tokens_per_s")]
    best = max(baselines, key=lambda m: summary[m]["tokens_per_s"], default=None)
    out["auto_vs_best_of_ar_ngram"] = r("auto", best) if best else None
    return {k: v for k, v in out.items() if v is not None or k in ("sync_vs_ar", "pipelined_vs_sync", "pipelined_vs_ar")}


def pipeline_efficiency(summary: dict) -> dict:
    """How much of a perfect pipeline's gain `pipelined` got over `sync` in this run. A perfect pipeline hides
    sync's exposed drafting behind the verification: at equal tau it would run (exposed draft + verify) / verify
    times sync's speed (`pipeline_gain_ideal`); `pipeline_efficiency` is the share of that gain obtained,
    (pipelined / sync - 1) / (ideal - 1): 1 = all of it, 0 = none, negative = slower than sync."""
    sync, pipelined = summary.get("sync", {}), summary.get("pipelined", {})
    exposed, verify = sync.get("exposed_draft_ms_mean"), sync.get("verify_ms_mean")
    if exposed is None or not verify or not sync.get("tokens_per_s") or not pipelined.get("tokens_per_s"):
        return {"pipeline_gain_ideal": None, "pipeline_efficiency": None}
    ideal = (exposed + verify) / verify
    gain = pipelined["tokens_per_s"] / sync["tokens_per_s"]
    return {"pipeline_gain_ideal": ideal, "pipeline_efficiency": (gain - 1) / (ideal - 1) if ideal > 1 else None}


def served_quantization(cfg: EngineConfig, dtype: torch.dtype) -> str:
    """What the target worker resolves `cfg.quantization` to (models/quantization.py; a split target: dense)."""
    if cfg.tensor_parallel_size > 1:
        return "none"
    gguf = gguf_source(resolve_target(cfg.target))
    return resolve_quantization(cfg.quantization, gguf, dtype, cfg.target_device)


def machine_info(cfg: EngineConfig) -> dict:
    dtype = resolve_dtype(cfg.dtype, cfg.target_device)
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "target_device": cfg.target_device, "drafter_device": cfg.drafter_device,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "target_threads": cfg.target_threads, "drafter_threads": cfg.drafter_threads,
            "borrow_drafter_threads": cfg.borrow_drafter_threads and not cfg.pinned, "cpu_linear": cfg.cpu_linear,
            "target_cores": cfg.target_cores, "drafter_cores": cfg.drafter_cores,
            "compile": cfg.compile, "drafter_compile": cfg.drafter_compile,
            "dtype": str(dtype).replace("torch.", ""), "quantization": served_quantization(cfg, dtype),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def run_bench(args: argparse.Namespace, cfg: EngineConfig) -> int:
    if getattr(args, "concurrency", ""):
        return run_load_bench(args, cfg)
    report = asyncio.run(bench(args, cfg))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    write_chart(report, out.with_suffix(".png"))
    shown = {k: report[k] for k in ("modes", "ratios", "nucleus", "refinement", "peers") if k in report}
    print(json.dumps(shown, indent=2))
    print(f"[bench] report: {out} (chart {out.with_suffix('.png')})")
    return 0


def run_load_bench(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """--concurrency: the load benchmark (bench/load.py) in place of the in-process runs."""
    from .load import load_bench
    from .report import write_load_chart

    others = ["--" + f.replace("_", "-") for f in ("nucleus_thresholds", "refinement_ablation")
              if getattr(args, f, "")]
    if others:
        raise ConfigError(f"--concurrency runs the load benchmark alone; run {', '.join(others)} without it")
    report = asyncio.run(load_bench(args, cfg))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    write_load_chart(report, out.with_suffix(".png"))
    print(json.dumps(report["ratios_vs_ar"], indent=2))
    print(f"[bench] load report: {out} (chart {out.with_suffix('.png')})")
    return 0
