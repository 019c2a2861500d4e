"""First user turns of one chat label shard, as a prompt file for `eval-drafter --prompts FILE`.

τ on these (requests of the same self-instruct plan as the training data, from a shard the run did not label)
against τ on the chat set shows how much of the gap is the chat set's requests rather than the model.

    python scripts/shard_prompts.py data/chat/shard-00018.npz --limit 24 > prompts.jsonl

Only greedy answers' conversations are taken (their requests are what `eval-drafter` answers greedily).
"""
from __future__ import annotations

import argparse
import json
import re

import numpy as np

from foresight.models.loading import load_tokenizer, resolve_target

USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)  # SmolLM2's ChatML template


def first_user_turns(shard: str, tokenizer) -> list[dict]:
    z = np.load(shard)
    offsets, sampled = z["offsets"], z["sampled"]
    items = []
    for i in range(len(sampled)):
        if sampled[i]:
            continue
        text = tokenizer.decode(z["tokens"][offsets[i]:offsets[i + 1]].tolist())
        turn = USER_TURN.search(text)
        if turn:
            items.append({"id": f"shard-{i}", "messages": [{"role": "user", "content": turn.group(1)}]})
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shard", help="a data/chat shard (.npz)")
    p.add_argument("--limit", type=int, default=24)
    args = p.parse_args()
    for item in first_user_turns(args.shard, load_tokenizer(resolve_target(None)))[:args.limit]:
        print(json.dumps(item))


if __name__ == "__main__":
    main()
