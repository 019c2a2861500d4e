"""Draft models' training loss on chosen stretches of a labelled data dir: seen against unseen sequences.

A model trained on some of a data dir's sequences and scored on the rest shows how much of its training gain
carries to text it never saw (the same fixed batches as `train drafter --holdout` scores at its checkpoints):

    python scripts/drafter_split_loss.py DATA checkpoints/smollm2-135m-instruct RUN \
        --ranges 0:1651,1651:4016,4016:4309 --out split-loss.json

A range is `first:end` over the data dir's sequences in their order (streams as meta.json lists them, each in
its shards' append order).
"""
from __future__ import annotations

import argparse
import json

import torch

from foresight.models.draft_model import DraftModel, SharedWeights
from foresight.models.loading import load_target, resolve_target
from foresight.training.dataset import LabelledData
from foresight.training.train_drafter import TrainSettings, score_split, vocab_subset_index


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a labelled data dir (train drafter --phase label)")
    p.add_argument("drafters", nargs="+", help="draft checkpoint folders")
    p.add_argument("--ranges", required=True, help="comma list of first:end sequence ranges")
    p.add_argument("--batch-seqs", type=int, default=16)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--loss-positions", type=int, default=8)
    p.add_argument("--batches", type=int, default=12, help="fixed batches per range")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the scores here as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = LabelledData(args.data)
    shared = SharedWeights.from_target(load_target(resolve_target(None), torch.float32, "cpu"))
    scores = {}
    for path in args.drafters:
        model = DraftModel.load(path, shared)
        s = TrainSettings(batch_seqs=args.batch_seqs, anchors=args.anchors, block_size=model.config.block_size,
                          loss_positions=args.loss_positions, context_window=model.config.context_window)
        subset_index = vocab_subset_index(model)
        for span in args.ranges.split(","):
            first, end = (int(x) for x in span.split(":"))
            seqs = torch.zeros(len(data), dtype=torch.bool)
            seqs[first:end] = True
            score = score_split(model, data, seqs, s, subset_index, False, args.batches)
            scores.setdefault(path, {})[span] = score
            print(path, span, {k: round(v, 4) for k, v in score.items()}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"data": args.data, "settings": vars(args), "scores": scores}, f, indent=1)


if __name__ == "__main__":
    main()
