"""`foresight train drafter|adapter`, `foresight eval-drafter`, `foresight eval-foresight` and
`foresight calibrate-foresight`.

    foresight train drafter --out DIR [--device cpu|cuda] [--steps N] [--data-dir DIR] [--resume] [--seed S]
        phase "label": teacher-force the target over the token shards of --shards (data/chat), stdlib
        conversations (and, with --regen N, over its own answers to N prompts) and store hidden states + top-k
        once in the data dir (resumable; the data dir is a cache outside the repository);
        phase "train": train the draft model on the labelled data, checkpointing into --out (resumable).
    foresight train label [--out data/chat] [--url URL] [--concurrency N] [--time-budget S] [--items N] [engine flags]
        the target's own chat answers through the serving engine, kept as token-id shards in the repository
        (training/engine_labels.py; resumable, append-only).
    foresight train adapter --data-dir DIR --out DIR [--steps N] [--resume] [--threads T] [--device cpu|cuda]
                            [--decoder-layers N --kl-weight W] [--state-weight W] [--time-budget SECONDS]
        train the hidden-to-hidden adapter on labelled data (resumable; see training/train_adapter.py). The loss
        is state_weight * (Smooth L1 + cosine on the predicted states) + kl_weight * KL from the target's next-
        token law to what the foresight decoder's N top layers make of the prediction (training/adapter_kl.py).
    foresight eval-drafter --drafter DIR [--prompts humaneval] [--limit N] [--temperatures 0,1]
                           [--block-sizes 8,16,32] [--passes 0,1,2,3] --out report.json
    foresight eval-foresight [--drafter DIR] [--decoder-layers 3,15] [--cache-sizes 1,2,4,8,16] --out report.json
        offline replay of the outcomes foresight selects: hit rate per cache size B and decoder depth, by the
        decoder's Eq. 6 scores and by the calibrated ones (--calibration, default the shipped one).
    foresight calibrate-foresight [--prompts calibration] --out <adapter>/calibration.json
        fit the outcome-score calibration (JetSpec++ appendix B.1) on held-out rounds at T=0 and T=1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

COMMANDS = ("train", "eval-drafter", "eval-foresight", "calibrate-foresight")

# Recipes: the CPU one runs in the background for hours and resumes; the GPU one labels more (with the
# target's own answers) and trains bigger batches in one short run.
# Chat: requests the target writes and answers (training/chat_data.py), labelled before the code streams.
RECIPES = {
    "cpu": dict(tokens=300_000, regen=0, regen_batch=8, chat=1500, chat_tokens=None, steps=6000, batch_seqs=4,
                anchors=16, label_batch=1, ckpt_every=200, label_dtype="float32"),
    "cuda": dict(tokens=3_000_000, regen=2000, regen_batch=1024, chat=12000, chat_tokens=None, steps=20000,
                 batch_seqs=64, anchors=16, label_batch=32, ckpt_every=2000, label_dtype="float32"),
}


def add_train_args(sub) -> None:
    """Register `train drafter|adapter`, `eval-drafter`, `eval-foresight` and `calibrate-foresight` on the
    top-level subparsers."""
    train = sub.add_parser("train", help="train drafter models")
    what = train.add_subparsers(dest="train_what", required=True)
    d = what.add_parser("drafter", help="label data with the target and train the JetSpec draft model")
    d.add_argument("--out", required=True, help="checkpoint folder to write (and resume from)")
    d.add_argument("--device", default="cpu", help="cpu | cuda[:i] (picks the recipe defaults)")
    d.add_argument("--target", default=None, help="target HF folder (default: embedded SmolLM2-135M-Instruct)")
    d.add_argument("--data-dir", default=None, help="labelled data (default ~/.cache/foresight/train/<target>-...)")
    d.add_argument("--phase", default="all", choices=("all", "label", "train"))
    d.add_argument("--tokens", type=int, default=None, help="teacher-forced tokens to label (recipe default)")
    d.add_argument("--regen", type=int, default=None, help="prompts the target answers itself (recipe default)")
    d.add_argument("--regen-batch", type=int, default=None, help="prompts per generate call (recipe default)")
    d.add_argument("--chat", type=int, default=None,
                   help="chat requests the target writes (self-instruct) and answers, 0 = none (recipe default)")
    d.add_argument("--chat-tokens", type=int, default=None, help="stop the chat stream at this many tokens")
    d.add_argument("--shards", default=None,
                   help="a folder of token-id shards (`train label` writes data/chat): teacher-force the target over "
                        "every sequence in it first (resumes after the sequences already labelled)")
    d.add_argument("--label-time", type=float, default=0.0,
                   help="seconds for the label phase: no generate/label call starts that would end after it "
                        "(what is labelled is kept; 0 = no limit)")
    d.add_argument("--label-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the target's dtype while labelling (recipe default float32)")
    d.add_argument("--init", default="random",
                   help="random | target (draft layers from the target's top attention layers; a hybrid target's "
                        "full-attention ones, refused if it has fewer than --layers) | a draft checkpoint folder "
                        "(warm start); ignored on --resume")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--batch-seqs", type=int, default=None)
    d.add_argument("--anchors", type=int, default=None, help="blocks per sequence per step")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--loss-positions", type=int, default=0,
                   help="train only the first P positions of each block (the model keeps --block-size); 0 = all")
    d.add_argument("--holdout", type=float, default=0.0,
                   help="share of the labelled sequences kept out of training, scored at each checkpoint (0 = none)")
    d.add_argument("--layers", type=int, default=3, help="draft transformer layers")
    d.add_argument("--target-layers", default=None, help="comma list of target hidden-state indices")
    d.add_argument("--vocab-subset", type=int, default=14500, help="0 = full vocabulary")
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--ckpt-every", type=int, default=None)
    d.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds of training: after a few timed steps, --steps is cut to what fits (0 = no limit)")
    d.add_argument("--label-batch", type=int, default=None)
    d.add_argument("--max-len", type=int, default=1024)
    d.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--resume", action="store_true", help="continue the training state in --out")

    lab = what.add_parser("label", help="the target's own chat answers through the serving engine, as token-id "
                                        "shards in the repository (training/engine_labels.py)")
    from ..config import add_engine_args

    add_engine_args(lab)  # the server started here (none with --url); --seed seeds its draws and the plan
    lab.add_argument("--out", default="data/chat", help="the shards' folder (append-only; default data/chat)")
    lab.add_argument("--url", default=None, help="a running server to label through (default: start one)")
    lab.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    lab.add_argument("--time-budget", type=float, default=0.0,
                     help="seconds: no item starts after it, those running finish (0 = no limit)")
    lab.add_argument("--items", type=int, default=0, help="plan items to finish in this run (0 = no limit)")
    lab.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)

    a = what.add_parser("adapter", help="train the hidden-to-hidden adapter on labelled data")
    a.add_argument("--data-dir", required=True, help="labelled data (from `train drafter --phase label`)")
    a.add_argument("--out", required=True, help="checkpoint folder to write (and resume from)")
    a.add_argument("--target", default=None, help="target HF folder (default: embedded SmolLM2-135M-Instruct)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--steps", type=int, default=None)
    a.add_argument("--batch-seqs", type=int, default=None)
    a.add_argument("--anchors", type=int, default=None, help="blocks per sequence per step")
    a.add_argument("--block-size", type=int, default=None, help="gamma + 1")
    a.add_argument("--layers-per-stage", type=int, default=None)
    a.add_argument("--bottom-layers", type=int, default=None,
                   help="depth of the bottom stage (default: --layers-per-stage); 3 = all layers below index 3")
    a.add_argument("--indices", default=None, help="comma list of target hidden-state indices to predict")
    a.add_argument("--decoder-layers", type=int, default=None,
                   help="record the foresight decoder depth to serve the adapter with (its input index must be "
                        "one the adapter predicts; default: all target layers above the deepest); with "
                        "--kl-weight, the depth the KL trains through")
    a.add_argument("--init", default=None,
                   help="an adapter checkpoint folder to start from (its stages and indices) instead of target layers")
    a.add_argument("--deepen-top", type=int, default=None,
                   help="with --init: add this many layers to the top stage, below its own, each starting as the "
                        "identity (copies of the target layers below, output projections zeroed)")
    a.add_argument("--train-top-only", action="store_true", help="freeze every stage but the top one")
    a.add_argument("--kl-weight", type=float, default=None,
                   help="weight of the KL from the target's stored top-k next-token law to the law the frozen top "
                        "--decoder-layers layers + norm + LM head give on the predicted states (the decoder's "
                        "output; needs --decoder-layers). Default 0: the state loss alone")
    a.add_argument("--state-weight", type=float, default=None,
                   help="weight of the state loss (Smooth L1 + cosine on the predicted hidden states; default 1)")
    a.add_argument("--lr", type=float, default=None)
    a.add_argument("--ckpt-every", type=int, default=None)
    a.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: after a few timed steps, --steps is cut to what fits (0 = no limit)")
    a.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    a.add_argument("--seed", type=int, default=None)
    a.add_argument("--resume", action="store_true", help="continue the training state in --out")

    e = sub.add_parser("eval-drafter", help="offline speculative decoding with a drafter: tau per J, T, block size")
    e.add_argument("--drafter", required=True, help="drafter checkpoint folder (or ngram)")
    e.add_argument("--target", default=None)
    e.add_argument("--prompts", default="humaneval", help="humaneval | chat | JSONL file")
    e.add_argument("--limit", type=int, default=None)
    e.add_argument("--temperatures", default="0,1")
    e.add_argument("--block-sizes", default="8,16,32")
    e.add_argument("--passes", default="0,1,2,3")
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--drafter-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the draft model's dtype (auto: as the drafter worker picks it)")
    e.add_argument("--device", default="cpu")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", required=True)

    f = sub.add_parser("eval-foresight", help="offline replay of foresight outcome selection: hit rate per cache size "
                                              "and decoder depth")
    f.add_argument("--drafter", default="auto", help="drafter checkpoint folder with its adapter (default: shipped)")
    f.add_argument("--adapter", default="auto", help="auto (<drafter>/adapter) | PATH")
    f.add_argument("--target", default=None)
    f.add_argument("--prompts", default="humaneval", help="humaneval | chat | JSONL file")
    f.add_argument("--offset", type=int, default=1, help="skip this many prompts first")
    f.add_argument("--limit", type=int, default=5)
    f.add_argument("--decoder-layers", default="0,3,15",
                   help="comma list of decoder depths to compare (0: the draft model's own scores)")
    f.add_argument("--cache-sizes", default="1,2,4,8,16")
    f.add_argument("--serve-cache-size", type=int, default=4,
                   help="the cache size served (--cache-size), whose hit rate the recommended depth maximises")
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--passes", type=int, default=0, help="Jacobi passes of the replayed drafts (0: a miss's J0)")
    f.add_argument("--max-tokens", type=int, default=128)
    f.add_argument("--temperature", type=float, default=0.0, help="0: greedy verification; > 0: sampled")
    f.add_argument("--calibration", default="auto",
                   help="auto (<adapter>/calibration.json if present) | none | PATH: also rank by calibrated scores")
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--record", action="store_true",
                   help="write the recommended depth into the adapter's config.json (decoder_layers): served by default")
    f.add_argument("--out", required=True)

    c = sub.add_parser("calibrate-foresight", help="fit the outcome-score calibration (JetSpec++ B.1) on held-out "
                                                   "rounds")
    c.add_argument("--drafter", default="auto", help="drafter checkpoint folder with its adapter (default: shipped)")
    c.add_argument("--adapter", default="auto", help="auto (<drafter>/adapter) | PATH")
    c.add_argument("--target", default=None)
    c.add_argument("--prompts", default="calibration",
                   help="calibration (the held-out set, default) | JSONL file; never an evaluation set")
    c.add_argument("--offset", type=int, default=0)
    c.add_argument("--limit", type=int, default=48)
    c.add_argument("--decoder-layers", type=int, default=None, help="the depth served (default: the adapter's)")
    c.add_argument("--temperatures", default="0,1")
    c.add_argument("--block-size", type=int, default=8, help="anchor + drafts per round (the served default)")
    c.add_argument("--max-tokens", type=int, default=96)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--out", required=True, help="where to write calibration.json (ship it beside the adapter)")


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    if args.command == "calibrate-foresight":
        from .calibrate_foresight import run_calibrate

        run_calibrate(args)
        return 0
    if args.command == "eval-foresight":
        from .eval_foresight import run_eval_foresight

        run_eval_foresight(args)
        return 0
    if args.command == "eval-drafter":
        from .eval_drafter import run_eval

        report = run_eval(args)
        print(json.dumps(report["summary"], indent=1))
        return 0
    if args.train_what == "adapter":
        return train_adapter_cmd(args)
    if args.train_what == "label":
        return label_cmd(args)
    return train_drafter(args)


def label_cmd(args: argparse.Namespace) -> int:
    import asyncio

    from ..config import engine_from_args
    from .engine_labels import label_with_server

    counts = asyncio.run(label_with_server(args, engine_from_args(args)))
    print(json.dumps(counts, indent=1))
    return 0


def train_adapter_cmd(args: argparse.Namespace) -> int:
    import torch

    from ..models.loading import load_target, resolve_target
    from .dataset import LabelledData
    from .train_adapter import AdapterTrainSettings, train_adapter

    given = dict(steps=args.steps, batch_seqs=args.batch_seqs, anchors=args.anchors, block_size=args.block_size,
                 layers_per_stage=args.layers_per_stage, bottom_layers=args.bottom_layers, lr=args.lr,
                 ckpt_every=args.ckpt_every, seed=args.seed,
                 decoder_layers=args.decoder_layers, init=args.init, deepen_top=args.deepen_top,
                 train_top_only=args.train_top_only or None, kl_weight=args.kl_weight, state_weight=args.state_weight,
                 time_budget_s=args.time_budget,
                 target_indices=[int(x) for x in args.indices.split(",")] if args.indices else None)
    s = AdapterTrainSettings(device=args.device, **{k: v for k, v in given.items() if v is not None})
    target = load_target(resolve_target(args.target), torch.float32, args.device)
    t0 = time.perf_counter()
    report = train_adapter(target, LabelledData(args.data_dir), Path(args.out), s, resume=args.resume)
    print(json.dumps({"out": args.out, "steps_done": report["steps_done"], "last50_mean": report["last50_mean"],
                      "train_s": time.perf_counter() - t0}, indent=1))
    return 0


def label_streams(labeller, data, tokenizer, pick, seed: int, shards: str | None = None) -> None:
    """The repository's token shards (`shards`), the chat stream (requests the target writes, then answers), then
    the code streams (teacher-forced stdlib conversations, the target's answers to their prompts); `pick(name)`
    gives a recipe setting."""
    from ..target_worker.steps import eos_ids
    from .chat_data import chat_requests, label_chat
    from .corpus import training_conversations
    from .labelling import chat_ids, label_all, label_shards

    if shards:
        label_shards(labeller, data, Path(shards))
    eos = eos_ids(labeller.model)
    encode = lambda messages, prompt: chat_ids(tokenizer, messages, prompt)  # noqa: E731
    if pick("chat") > 0:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        encode_text = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        requests = chat_requests(labeller, data, encode, encode_text, decode, pick("chat"), seed, eos)
        label_chat(labeller, data, requests, encode, decode, eos, seed, pick("chat_tokens"))
    if pick("tokens") > 0 or pick("regen") > 0:
        convs, dropped = training_conversations(seed)
        data.meta["dropped_eval_overlap"] = dropped
        data.save_meta()
        print(f"[train] {len(convs)} stdlib conversations ({dropped} dropped for overlap with HumanEval); "
              f"data dir {data.path}", file=sys.stderr)
        label_all(labeller, data, convs, encode, pick("tokens"), pick("regen"), eos, seed)


def train_drafter(args: argparse.Namespace) -> int:
    import torch

    from ..models.draft_model import default_target_layers
    from ..models.loading import cache_root, load_target, load_tokenizer, resolve_target
    from .draft_init import validate_init
    from .dataset import LabelledData
    from .labelling import DataDir, LabelSettings, Labeller
    from .train_drafter import TrainSettings, train

    recipe = RECIPES["cuda" if args.device.startswith("cuda") else "cpu"]
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else recipe[name]  # noqa: E731
    path = resolve_target(args.target)
    target = load_target(path, getattr(torch, pick("label_dtype")), args.device)
    # Before any labelling: --init target needs as many attention layers in the target as --layers.
    init = validate_init(args.init, target, args.layers) if args.phase in ("all", "train") else args.init
    n_layers = target.config.num_hidden_layers
    layers = [int(x) for x in args.target_layers.split(",")] if args.target_layers else default_target_layers(n_layers)
    topk = 32
    data_dir = Path(args.data_dir) if args.data_dir else \
        cache_root() / "train" / f"{path.name}-L{'_'.join(map(str, layers))}-k{topk}"
    header = {"target_name": path.name, "layers": layers, "topk": topk, "max_len": args.max_len, "seed": args.seed}
    timings = {}
    if args.phase in ("all", "label"):
        t0 = time.perf_counter()
        data = DataDir(data_dir, header)
        before = sum(st["tokens"] for st in data.meta["streams"].values())
        tokenizer = load_tokenizer(path)
        settings = LabelSettings(layers=layers, topk=topk, max_len=args.max_len, batch_size=pick("label_batch"),
                                 regen_batch=pick("regen_batch"),
                                 deadline=time.monotonic() + args.label_time if args.label_time > 0 else 0.0)
        label_streams(Labeller(target, settings), data, tokenizer, pick, args.seed, args.shards)
        after = sum(st["tokens"] for st in data.meta["streams"].values())
        timings["label_s"] = time.perf_counter() - t0
        timings["labelled_tokens"] = after - before
        timings["labelled_tokens_per_s"] = round((after - before) / max(timings["label_s"], 1e-9), 1)
        timings["streams"] = {name: {k: st[k] for k in ("items_done", "sequences", "tokens")}
                              for name, st in data.meta["streams"].items()}
    if args.phase in ("all", "train"):
        names = {f.name for f in fields(TrainSettings)}
        s = TrainSettings(**{k: v for k, v in dict(
            steps=pick("steps"), batch_seqs=pick("batch_seqs"), anchors=pick("anchors"), block_size=args.block_size,
            loss_positions=args.loss_positions, holdout=args.holdout, num_layers=args.layers,
            vocab_subset=args.vocab_subset, lr=args.lr, ckpt_every=pick("ckpt_every"),
            seed=args.seed, device=args.device, time_budget_s=args.time_budget,
            init=init).items() if k in names})
        target = target.float()  # shared embedding / LM head in fp32 for training
        t0 = time.perf_counter()
        report = train(target, LabelledData(data_dir), Path(args.out), s, resume=args.resume)
        timings["train_s"] = time.perf_counter() - t0
        print(json.dumps({"out": args.out, "steps_done": report["steps_done"], "last50_mean": report["last50_mean"],
                          "last_eval": (report["evals"] or [None])[-1], **timings}, indent=1))
    else:
        print(json.dumps(timings, indent=1))
    return 0
