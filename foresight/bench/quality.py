"""`foresight eval-quality`: what nucleus (relaxed) verification costs in HumanEval pass@1.

Every verification setting answers every problem in ONE run of the real engine (api-side client, target and
drafter worker processes), interleaved problem by problem as in `foresight bench`, so speed is compared
within the run. After the engine stops, the answers are checked in a sandbox (`humaneval_check`) and
scored by the target itself: teacher-forced fp32 forwards (each prompt once, its distinct answers
continuing from its cache) give their mean negative log-likelihood per token, which tells whether relaxed
acceptances pushed the output off what the target prefers even where the tests cannot tell.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, EngineConfig
from ..models.loading import load_target, load_tokenizer, resolve_target
from . import humaneval_check
from .harness import ModeTally, Run, build_requests, engine_session, machine_info, run_interleaved
from .prompts import humaneval_chat, humaneval_problems
from .report import write_quality_chart

QUALITY_MODES = ("sync", "pipelined")
# Positions per scoring forward (rows x longest row), bounding the [batch, width, vocab] logits. 1 = one
# answer per forward: on a CPU padding costs more than batching saves (40 answers of ~200 tokens, fp32,
# 1 thread: 40.7 s one by one, 48.7 s in batches of 2048 positions, 60.1 s before the prompt was shared).
SCORE_BATCH_TOKENS = 1


@dataclass(frozen=True)
class Setting:
    """One verification rule to evaluate: exact, or nucleus at threshold theta."""

    verification: str  # "exact" | "nucleus"
    theta: float | None = None

    @property
    def key(self) -> str:
        return "exact" if self.verification == "exact" else f"nucleus@{self.theta:g}"


def parse_settings(text: str) -> list[Setting]:
    """`exact,nucleus@0.9,...` -> settings, duplicates dropped, order kept."""
    settings: dict[str, Setting] = {}
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        setting = _parse_setting(raw)
        settings.setdefault(setting.key, setting)
    if not settings:
        raise ConfigError("--verification: give at least one setting (exact or nucleus@θ)")
    return list(settings.values())


def _parse_setting(raw: str) -> Setting:
    if raw == "exact":
        return Setting("exact")
    name, sep, value = raw.partition("@")
    try:
        theta = float(value) if name == "nucleus" and sep else None
    except ValueError:
        theta = None
    if theta is None or not 0.0 < theta <= 1.0:
        raise ConfigError(f"--verification: {raw!r} is not a setting; use exact or nucleus@θ with θ in (0, 1] "
                          f"(e.g. exact,nucleus@0.9)")
    return Setting("nucleus", theta)


def add_quality_args(p: argparse.ArgumentParser) -> None:
    """Flags of eval-quality. The parser must use conflict_handler='resolve': --verification and --mode
    replace the engine flags of the same name (a list of settings here, and only speculative modes)."""
    g = p.add_argument_group("quality evaluation")
    g.add_argument("--prompts", default="humaneval", help="problem set (only 'humaneval': answers are checked)")
    g.add_argument("--verification", dest="settings", default="exact,nucleus@0.8,nucleus@0.9,nucleus@0.95",
                   help="comma-separated settings: exact and/or nucleus@θ (θ in (0, 1])")
    g.add_argument("--mode", default="sync", choices=QUALITY_MODES, help="speculative mode of every setting")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=384)
    g.add_argument("--limit", type=int, default=None, help="first N problems only")
    g.add_argument("--out", default="eval-quality.json")


@dataclass
class Answers:
    """What one setting produced: the engine tally (speed, tau, token outputs) and the checks."""

    run: Run
    tally: ModeTally
    texts: list[str] | None = None
    checks: list[humaneval_check.CheckResult] | None = None
    nll_sum: float = 0.0


async def generate(args: argparse.Namespace, cfg: EngineConfig, problems: list[dict],
                   settings: list[Setting]) -> tuple[list[Answers], list[list[int]], str]:
    """All settings on all problems through the engine; returns the answers, prompt ids and drafter name."""
    runs = [Run(s.key, cfg.mode, s.verification, s.theta if s.theta is not None else cfg.nucleus_threshold)
            for s in settings]
    async with engine_session(cfg, "eval-quality") as (engine, runner, info):
        drafter = info.get("proposer", cfg.drafter)
        requests = build_requests(runner, [humaneval_chat(p) for p in problems], args)
        answers = [Answers(run, ModeTally()) for run in runs]
        await run_interleaved(engine, requests, runs, {a.run.label: a.tally for a in answers}, "eval-quality")
    return answers, [r.prompt_ids for r in requests], drafter


def check_answers(answers: list[Answers], problems: list[dict], tokenizer) -> None:
    for a in answers:
        a.texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in a.tally.outputs]
        a.checks = [humaneval_check.check(p, text) for p, text in zip(problems, a.texts)]


def score_nll(answers: list[Answers], prompt_ids: list[list[int]], target: Path) -> None:
    """Sum of the target's NLL of each setting's answer tokens (fp32 CPU, temperature 1). Runs after the
    engine has stopped, so it does not compete with the workers for the CPU."""
    model = load_target(target, torch.float32, "cpu")
    distinct: dict[int, dict[tuple[int, ...], float]] = {}  # problem -> answer -> NLL; settings often agree
    for a in answers:
        for i, ids in enumerate(a.tally.outputs):
            distinct.setdefault(i, {})[tuple(ids)] = 0.0
    for i, scores in distinct.items():
        outs = list(scores)
        scores.update(zip(outs, answers_nll(model, prompt_ids[i], [list(o) for o in outs])))
    for a in answers:
        for i, ids in enumerate(a.tally.outputs):
            a.nll_sum += distinct[i][tuple(ids)]


@torch.inference_mode()
def answers_nll(model, prompt_ids: list[int], answers: list[list[int]],
                max_tokens: int = SCORE_BATCH_TOKENS) -> list[float]:
    """Summed NLL of each answer given the same prompt (teacher-forced). The prompt runs once; the answers
    then continue from its cache in right-padded batches of about `max_tokens` positions."""
    from transformers import DynamicCache  # imported here: the CLI must start without transformers

    cache = DynamicCache(config=model.config)
    if len(prompt_ids) > 1:
        # All but the prompt's last token: that one is fed with each answer, its row predicts answer[0].
        model(torch.tensor([prompt_ids[:-1]]), cache=cache, use_cache=True, logits_to_keep=1)
    nll = [0.0] * len(answers)
    for batch in _batches([k for k, a in enumerate(answers) if a], answers, max_tokens):
        rows = [[prompt_ids[-1], *answers[k]] for k in batch]
        for k, value in zip(batch, _continue_nll(model, copy.deepcopy(cache), rows)):
            nll[k] = value
    return nll


def _batches(order: list[int], answers: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Answer indices, longest first, grouped so rows x longest row stays within max_tokens."""
    order = sorted(order, key=lambda k: -len(answers[k]))
    batches: list[list[int]] = []
    for k in order:
        if batches and (len(batches[-1]) + 1) * (len(answers[batches[-1][0]]) + 1) <= max_tokens:
            batches[-1].append(k)
        else:
            batches.append([k])
    return batches


def _continue_nll(model, cache, rows: list[list[int]]) -> list[float]:
    """Summed NLL of rows[r][1:] after what `cache` holds (one sequence, repeated for each row)."""
    width, past = max(map(len, rows)), cache.get_seq_length()
    cache.reorder_cache(torch.zeros(len(rows), dtype=torch.long))  # batch 1 -> len(rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # [batch, width], right-padded
    real = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [batch, width]
    mask = torch.cat([torch.ones(len(rows), past, dtype=torch.long), real], dim=1)  # [batch, past + width]
    logits = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits  # [batch, width, vocab]
    # Column j predicts token j + 1: keep the columns whose next token is a real answer token.
    keep = real[:, 1:].bool()  # [batch, width - 1]
    logp = torch.log_softmax(logits[:, :-1][keep].float(), dim=-1)  # [answer tokens, vocab]
    logp = logp.gather(1, ids[:, 1:][keep][:, None])  # [answer tokens, 1], row-major: answers in order
    return [-part.sum().item() for part in logp.split([len(r) - 1 for r in rows])]


def results_section(answers: list[Answers]) -> dict:
    exact = next((a for a in answers if a.run.verification == "exact"), None)
    out = {}
    for a in answers:
        t = a.tally
        s = t.summary(a.run.mode, None)
        n = len(t.outputs)
        differ = None
        if exact is not None:
            differ = sum(x != y for x, y in zip(exact.tally.outputs, t.outputs)) / max(n, 1)
        out[a.run.label] = {
            "verification": a.run.verification,
            "theta": a.run.theta if a.run.verification == "nucleus" else None,
            "n_problems": n,
            "pass_at_1": sum(c.passed for c in a.checks) / max(n, 1),
            "tokens_per_s": s["tokens_per_s"],
            "tau": s["tau"],
            "nucleus_extra_accepted_tokens": t.nucleus_extra,
            "nll_mean": a.nll_sum / t.output_tokens if t.output_tokens else None,
            "output_tokens": t.output_tokens,
            "outputs_differ_from_exact": differ,
        }
    return out


def problems_section(answers: list[Answers], problems: list[dict]) -> list[dict]:
    """Per problem and setting: the verdict, the answer's length and text (to audit failures and extraction)."""
    return [{"task_id": p["task_id"],
             "results": {a.run.label: {"passed": a.checks[i].passed, "result": a.checks[i].result,
                                       "output_tokens": len(a.tally.outputs[i]), "answer": a.texts[i]}
                         for a in answers}}
            for i, p in enumerate(problems)]


def select_problems(args: argparse.Namespace) -> list[dict]:
    if args.prompts != "humaneval":
        raise ConfigError(f"--prompts: eval-quality checks answers with HumanEval tests; only 'humaneval' "
                          f"is supported (got {args.prompts!r})")
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be >= 1")
    problems = humaneval_problems()
    return problems[:args.limit] if args.limit else problems


def evaluate(args: argparse.Namespace, cfg: EngineConfig) -> dict:
    settings = parse_settings(args.settings)
    problems = select_problems(args)
    isolated = humaneval_check.network_isolated()  # decided once, before any model code runs
    answers, prompt_ids, drafter = asyncio.run(generate(args, cfg, problems, settings))
    target = resolve_target(cfg.target)
    check_answers(answers, problems, load_tokenizer(target))
    score_nll(answers, prompt_ids, target)
    machine = machine_info(cfg)
    return {
        "model": str(cfg.target or "SmolLM2-135M-Instruct (embedded default)"),
        "drafter": drafter,
        "machine": machine,
        "settings": {"prompts": args.prompts, "n_prompts": len(problems), "temperature": args.temperature,
                     "max_tokens": args.max_tokens, "mode": cfg.mode, "block_size": cfg.block_size,
                     "dtype": machine["dtype"], "seed": args.seed, "network_isolated": isolated,
                     "verification": [s.key for s in settings]},
        "results": results_section(answers),
        "problems": problems_section(answers, problems),
    }


def run_quality(args: argparse.Namespace, cfg: EngineConfig) -> int:
    report = evaluate(args, cfg)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    write_quality_chart(report, out.with_suffix(".png"))
    print(json.dumps({"settings": report["settings"], "results": report["results"]}, indent=2))
    print(f"[eval-quality] report: {out} (chart {out.with_suffix('.png')})")
    return 0
