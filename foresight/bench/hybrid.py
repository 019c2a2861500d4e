"""What foresight costs on a hybrid target (Gated DeltaNet + full attention), measured on a small random model.

Per verification round the target sends the drafter, besides the committed positions' states, the committed
recurrent + conv state of the linear-attention layers the foresight decoder runs (protocol `LinearStates`).
This measures, round by round on the real code paths:

    snapshot      its size in bytes, and the target's time to copy it out of the cache
    transport     an Outcome carrying the committed states, with and without the snapshot, sent over a
                  PUSH/PULL ipc socket pair as the workers do (encode, send, receive, decode), per tensor path
                  ("frame": zero-copy zmq frames; "shm": shared memory)
    decoder       the drafter's decoder over a block: one pass that also takes the new context states (needs
                  the snapshot), and two passes (extend, then score: what it does without one)
    verify        the target's verify forward + rollback, the time foresight must hide under

The model is random (weights do not change these costs) and built from a config, so it runs anywhere:

    python -m foresight.bench.hybrid --out docs/results/hybrid/tiny-qwen3_5.json

`paper_scale` adds what a snapshot weighs for the default configs of Qwen3.5 and Qwen3-Next in transformers
(computed from their shapes, not measured).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import zmq

from ..models.decoder import ForesightDecoder
from ..protocol.addresses import WorkerAddresses
from ..protocol.messages import HiddenLayout, Outcome
from ..protocol.sockets import MessageSocket
from ..protocol.transport import TensorTransport
from ..target_worker.runner import TargetRunner

__all__ = ["small_hybrid", "measure", "snapshot_bytes", "paper_scale"]


def small_hybrid(arch: str = "qwen3_5", hidden: int = 512, layers: int = 8):
    """A random hybrid model: 3 Gated DeltaNet layers then 1 full-attention layer, repeated."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                  linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                  max_position_embeddings=4096, tie_word_embeddings=True)
    if arch == "qwen3_next":
        config = Qwen3NextConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                 shared_expert_intermediate_size=hidden, **common)
    elif arch == "qwen3_5":
        config = Qwen3_5TextConfig(**common)
    else:
        raise ValueError(f"arch must be qwen3_5 or qwen3_next, got {arch!r}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def snapshot_bytes(config, layers: list[int], dtype_bytes: int = 2) -> int:
    """Bytes of one request's snapshot of `layers`: conv [conv_dim, kernel] in the model dtype and recurrent
    [v_heads, k_dim, v_dim] in float32, per layer."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    conv = conv_dim * config.linear_conv_kernel_dim * dtype_bytes
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return len(layers) * (conv + recurrent)


def paper_scale() -> dict:
    """Snapshot bytes for transformers' default Qwen3.5 and Qwen3-Next configs (bf16), decoder of the top 2
    and top 4 layers (1 and 3 of them Gated DeltaNet)."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    out = {}
    for name, config in (("qwen3_5_default", Qwen3_5TextConfig()), ("qwen3_next_default", Qwen3NextConfig())):
        n = config.num_hidden_layers
        out[name] = {f"decoder_{k}": snapshot_bytes(config, [i for i in range(n - k, n)
                                                             if config.layer_types[i] == "linear_attention"])
                     for k in (2, 4)}
    return out


def _median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3)


def _transport_s(outcome: Outcome, transport: TensorTransport, repeat: int = 5) -> float:
    """Encode, send, receive and decode `outcome` over an ipc PUSH/PULL pair: the median of `repeat`."""
    ctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    try:
        rx = MessageSocket(ctx, zmq.PULL, addrs.target_to_drafter, bind=True, transport=transport)
        tx = MessageSocket(ctx, zmq.PUSH, addrs.target_to_drafter, bind=False, transport=transport)
        tx.send(outcome)
        rx.recv(timeout_ms=5000)  # the connection is up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            tx.send(outcome)
            got = rx.recv(timeout_ms=5000)
            times.append(time.perf_counter() - t0)
            assert got is not None and got.round == outcome.round
        return statistics.median(times)
    finally:
        ctx.destroy(linger=0)
        addrs.remove()


@torch.inference_mode()
def measure(model, rounds: int = 48, gamma: int = 7, decoder_layers: int = 2, prompt_len: int = 128,
            seed: int = 0) -> dict:
    """Rounds of verify + rollback (accept lengths drawn uniformly) on one request, each followed by what the
    drafter does with its outcome; medians per round."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    dec = ForesightDecoder(model, decoder_layers)
    layout = HiddenLayout((dec.input_index,), model.config.hidden_size, tuple(dec.linear_layers))
    runner = TargetRunner(model, layout, logits="model")
    cache = runner.new_cache()
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    res = runner.prefill(cache, prompt)
    one, two = dec.new_cache(), dec.new_cache()  # the decoder with and without the target's snapshots
    for c in (one, two):
        dec.extend_context(c, res.hidden, 0, runner.linear_states(cache, prompt_len) if c is one else None)
    pos, anchor = prompt_len, int(torch.randint(0, vocab, (1,), generator=gen))
    t = {k: [] for k in ("verify", "snapshot", "decoder_one_pass", "decoder_two_passes")}
    sizes, outcomes = [], []
    for r in range(rounds):
        draft = torch.randint(0, vocab, (gamma,), generator=gen).tolist()
        k = int(torch.randint(0, gamma + 1, (1,), generator=gen))
        t0 = time.perf_counter()
        result = runner.verify(cache, anchor, draft)
        runner.rollback(cache, gamma - k, result)
        t1 = time.perf_counter()
        snap = runner.linear_states(cache, pos + k + 1)
        t2 = time.perf_counter()
        t["verify"].append(t1 - t0)
        t["snapshot"].append(t2 - t1)
        sizes.append(snap.nbytes)
        new = result.hidden[:k + 1]  # [k+1, hidden] committed positions' states at the decoder's input
        if r < 4:
            outcomes.append(Outcome(req_id="bench", round=r + 1, accepted=k, bonus=anchor, max_drafts=gamma,
                                    hidden=new.clone(), linear_states=snap))
        block = torch.randn(gamma + 1, model.config.hidden_size, generator=gen)  # stands in for the adapter's
        t3 = time.perf_counter()
        dec.logits_and_hidden(one, block, context_states=new, linear_states=snap)
        t4 = time.perf_counter()
        dec.logits_and_hidden(two, block, context_states=new)
        t5 = time.perf_counter()
        t["decoder_one_pass"].append(t4 - t3)
        t["decoder_two_passes"].append(t5 - t4)
        pos += k + 1
        anchor = draft[k] if k < gamma else int(torch.randint(0, vocab, (1,), generator=gen))
    assert one.stale == 0 and one.adopted == rounds + 1 and one.length == two.length == pos
    verify_ms = _median_ms(t["verify"])
    report = {
        "rounds": rounds, "gamma": gamma, "prompt_len": prompt_len, "decoder_layers": decoder_layers,
        "decoder_linear_layers": dec.linear_layers, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "snapshot_bytes": statistics.median(sizes),
        "committed_states_bytes_per_position": model.config.hidden_size * res.hidden.element_size(),
        **{f"{k}_ms_p50": _median_ms(v) for k, v in t.items()},
    }
    for name in ("decoder_one_pass", "decoder_two_passes"):
        report[f"{name}_vs_verify"] = round(report[f"{name}_ms_p50"] / verify_ms, 3)
    for path in ("frame", "shm"):
        transport = TensorTransport(inline_max=0, large=path)
        with_s = statistics.median(_transport_s(o, transport) for o in outcomes)
        without_s = statistics.median(_transport_s(dataclasses.replace(o, linear_states=None), transport) for o in outcomes)
        report[f"transport_{path}"] = {"outcome_with_snapshot_ms_p50": round(1e3 * with_s, 3),
                                       "outcome_without_snapshot_ms_p50": round(1e3 * without_s, 3)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foresight.bench.hybrid", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3_5,qwen3_next", help="comma-separated: qwen3_5, qwen3_next")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=48)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one per worker, as served)")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "paper_scale_snapshot_bytes": paper_scale(), "models": {}}
    for arch in args.arch.split(","):
        model = small_hybrid(arch, args.hidden, args.layers).to(getattr(torch, args.dtype))
        report["models"][arch] = {"hidden": args.hidden, "layers": args.layers,
                                  **measure(model, args.rounds, decoder_layers=args.decoder_layers)}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
