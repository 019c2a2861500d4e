"""Does the compiled draft pass pay? Drafting time per round, eager against compiled, side by side.

    .venv/bin/python scripts/compiled_draft.py [threads] [prompts] [limit] [bfloat16|float32]

Loads the embedded default target as served in that dtype (bf16 by default; its GGUF's int4 weights where
`--quantization auto` picks them; its steps eager: only the drafting time is compared) and the shipped draft model
in the same dtype as the drafter worker serves it (prepacked linears), then:
- the block pass alone (`DraftModel.pass_ids`) at a few batch shapes (rows x positions after a context of 200),
  eager and compiled (models/compiled_draft.py), ms per pass and the largest difference in confidence, and a
  context extension by 1 or 3 positions (`DraftModel.extend_context`, what each round adds);
- the offline round loop of `foresight eval-drafter` (sync, T=0, block 8, J0, the checkpoint's default) over the
  same prompts, eager then compiled: tau, drafting ms per round (context extension + the pass), and whether the
  drafts were the same.
"""
import sys
import time
from pathlib import Path

import torch

from foresight.bench.prompts import load_prompts
from foresight.config import EngineConfig
from foresight.drafter_worker.jetspec_proposer import JetSpecProposer, resolve_drafter_path
from foresight.models.compiled_draft import CompiledDraft
from foresight.models.cpu_linear import use_cpu_linears
from foresight.models.loading import cache_root, load_target, load_tokenizer, resolve_target
from foresight.models.quantization import apply_quantization
from foresight.target_worker.runner import TargetRunner
from foresight.target_worker.steps import eos_ids
from foresight.training.eval_drafter import speculate
from foresight.training.labelling import chat_ids

SHAPES = ((1, 3), (1, 8), (4, 8), (16, 8))  # rows x positions per pass
CONTEXT = 200  # context positions of every row


def per_call_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - t0) / repeats


def pass_timings(model, compiled: CompiledDraft) -> None:
    width = len(model.config.target_layers) * model.config.target_hidden_size
    g = torch.Generator().manual_seed(0)
    ctx = model.encode_context(torch.randn(CONTEXT, width, generator=g))
    for rows, tokens in SHAPES:
        batch = model.context_batch([ctx] * rows)
        inputs = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=g)
        with torch.inference_mode():
            model.compiled = None
            eager_ms = per_call_ms(lambda: model.pass_ids(inputs, batch))
            eager = model.pass_ids(inputs, batch)
            model.compiled = compiled
            graph_ms = per_call_ms(lambda: model.pass_ids(inputs, batch))
            graph = model.pass_ids(inputs, batch)
        same = (eager[0] == graph[0]).float().mean().item()
        print(f"pass {rows:>2} x {tokens}: eager {eager_ms:6.2f} ms  compiled {graph_ms:6.2f} ms  "
              f"({eager_ms / graph_ms:.2f}x; drafts equal {same:.3f}, "
              f"confidence within {(eager[1] - graph[1]).abs().max().item():.1e})", flush=True)
    for new in (1, 3):
        states = torch.randn(new, width, generator=g).to(model.dtype)  # as the target sends them
        timings = []
        for graph in (None, compiled):
            model.compiled = graph
            timings.append(per_call_ms(lambda: model.extend_context(ctx, states, CONTEXT)))
        model.compiled = None
        print(f"context + {new}: eager {timings[0]:6.2f} ms  compiled {timings[1]:6.2f} ms  "
              f"({timings[0] / timings[1]:.2f}x)", flush=True)


def round_loop(runner, proposer, prompts, eos) -> tuple[float, float, list]:
    rounds = committed = 0
    draft_s = 0.0
    outputs = []
    for i, prompt in enumerate(prompts):
        r = speculate(runner, proposer, prompt, 96, 0.0, 8, i, eos)
        rounds += len(r["accepted"])
        committed += sum(a + 1 for a in r["accepted"])
        draft_s += r["draft_s"]
        outputs.append(r["accepted"])
    return committed / rounds, 1e3 * draft_s / rounds, outputs


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    prompt_set = sys.argv[2] if len(sys.argv) > 2 else "chat"
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.bfloat16
    torch.set_num_threads(threads)
    path = resolve_target(None)
    target = load_target(path, dtype, "cpu")
    served = apply_quantization(target, "auto", path, "cpu", "target")
    proposer = JetSpecProposer.load(resolve_drafter_path(EngineConfig()), target, "cpu", dtype)
    use_cpu_linears(proposer.model, "auto", "cpu", "draft model")
    model = proposer.model
    compiled = CompiledDraft(model, cache_root() / "compiled", threads)
    compiled.build()
    print(f"draft model {model.dtype}, target {served}, {threads} thread(s); compiled pass: "
          f"{'loaded' if compiled.loaded else f'{compiled.compile_s:.1f} s compiling'}", flush=True)
    pass_timings(model, compiled)
    tokenizer = load_tokenizer(Path(path))
    prompts = [chat_ids(tokenizer, item["messages"], True) if "messages" in item
               else tokenizer.encode(item["prompt"], add_special_tokens=False)
               for item in load_prompts(prompt_set, limit)]
    runner = TargetRunner.for_proposer(target, proposer)
    results = {}
    for name, graph in (("eager", None), ("compiled", compiled), ("eager again", None)):
        model.compiled = graph
        results[name] = round_loop(runner, proposer, prompts, eos_ids(target))
        tau, draft_ms, _ = results[name]
        print(f"round loop {name:>11}: tau {tau:.3f}  drafting {draft_ms:5.2f} ms per round", flush=True)
    same = sum(a == b for a, b in zip(results["eager"][2], results["compiled"][2]))
    print(f"{len(prompts)} {prompt_set} prompts, 96 tokens, T=0, block 8: {same} of {len(prompts)} with the same "
          f"accepted lengths eager and compiled")


if __name__ == "__main__":
    main()
