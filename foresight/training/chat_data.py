"""The chat stream of the labelled set: the target writes the requests (self_instruct.py), then answers them.

    chat_requests.jsonl   the requests of a data dir, written once (sampling on a GPU is not bit-reproducible,
                          so resuming reads them back instead of writing them again)
    stream "chat"         the target's answers, greedy and sampled (T=0.8) batches in turn, a second turn
                          where the request has a follow-up; labelled like every other stream
Token counts per request kind accumulate in meta.json under "chat_kinds" (for the data card).
"""
from __future__ import annotations

import json
import sys
from typing import Callable

from .corpus import Decontaminator, chat_eval_texts, eval_texts
from .labelling import DataDir, Labeller, label_stream
from .self_instruct import ChatRequest, clean_written, from_record, plan, request_from, to_record, writer_messages

REQUESTS_FILE = "chat_requests.jsonl"
WRITE_TEMPERATURE, WRITE_TOP_P = 0.8, 0.95
MAX_NEW = {"written": 48, "passage": 160}
FOLLOW_UP_MAX_NEW = 160  # second answers are mostly short ("make it shorter"); a generate call runs to its longest

Encode = Callable[[list[dict], bool], list[int]]
Decode = Callable[[list[int]], str]
EncodeText = Callable[[str], list[int]]


def chat_requests(labeller: Labeller, data: DataDir, encode: Encode, encode_text: EncodeText, decode: Decode, n: int,
                  seed: int, eos: list[int], decontaminator: Decontaminator | None = None, log=print) -> list[ChatRequest]:
    """The data dir's requests: read back if written before, else planned, written by the target, cleaned,
    deduplicated and decontaminated (never an evaluation request), then saved."""
    path = data.path / REQUESTS_FILE
    if path.is_file():
        return [from_record(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    items = plan(n, seed)
    texts = _write_texts(labeller, items, encode, encode_text, decode, seed, eos)
    decontaminator = decontaminator or Decontaminator(eval_texts(), whole_short=chat_eval_texts())
    requests, seen, dropped = [], set(), {"unusable": 0, "duplicate": 0, "eval_overlap": 0}
    for i, item in enumerate(items):
        req = request_from(item, texts.get(i))
        key = req.messages[-1]["content"].lower() if req else None
        reason = "unusable" if req is None else "duplicate" if key in seen else \
            None if decontaminator.clean(key + "\n" + (req.follow_up or "")) else "eval_overlap"
        if reason:
            dropped[reason] += 1
            continue
        seen.add(key)
        requests.append(req)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(to_record(r)) + "\n" for r in requests))
    tmp.replace(path)
    data.meta["chat_requests"] = {"planned": n, "kept": len(requests), "dropped": dropped}
    data.save_meta()
    log(f"[chat] {len(requests)} requests kept of {n} planned (dropped {dropped})", file=sys.stderr)
    return requests


def _write_texts(labeller: Labeller, items: list[dict], encode: Encode, encode_text: EncodeText, decode: Decode,
                 seed: int, eos: list[int]) -> dict[int, str]:
    """Item index -> the target's cleaned request or passage, for the items that need one."""
    per_call = labeller.s.regen_batch or labeller.s.batch_size
    texts: dict[int, str] = {}
    for source, max_new in MAX_NEW.items():
        todo = [(i, writer_messages(it)) for i, it in enumerate(items) if it["source"] == source]
        for at in range(0, len(todo), per_call):
            chunk = todo[at:at + per_call]
            prompts = [encode_text(m) if isinstance(m, str) else encode(m, True) for _, m in chunk]
            outs = labeller.generate(prompts, True, seed + 7919 * (at + 1), eos, temperature=WRITE_TEMPERATURE,
                                     top_p=WRITE_TOP_P, max_new=max_new)
            for (i, _), prompt, out in zip(chunk, prompts, outs):
                text = clean_written(decode(out[len(prompt):]), passage=source == "passage")
                if text:
                    texts[i] = text
    return texts


def label_chat(labeller: Labeller, data: DataDir, requests: list[ChatRequest], encode: Encode, decode: Decode,
               eos: list[int], seed: int, max_tokens: int | None) -> None:
    """Label the target's answers to `requests` (resumable), up to `max_tokens` tokens in the stream."""
    per_call = labeller.s.regen_batch or labeller.s.batch_size
    kinds = data.meta.setdefault("chat_kinds", {})

    def answer(batch: list[ChatRequest], first: int) -> list[list[int]]:
        sample = (first // per_call) % 2 == 1  # greedy and sampled batches in turn
        prompts = [encode(r.messages, True) for r in batch]
        seqs = labeller.generate(prompts, sample, seed + first, eos)
        follow = [k for k, r in enumerate(batch) if r.follow_up]
        if follow:
            second = [encode(batch[k].messages + [
                {"role": "assistant", "content": decode(seqs[k][len(prompts[k]):]).strip()},
                {"role": "user", "content": batch[k].follow_up}], True) for k in follow]
            for k, seq in zip(follow, labeller.generate(second, sample, seed + first + 1, eos, max_new=FOLLOW_UP_MAX_NEW)):
                seqs[k] = seq
        for r, seq in zip(batch, seqs):
            kinds[r.kind] = kinds.get(r.kind, 0) + min(len(seq), labeller.s.max_len)
        return seqs

    label_stream(labeller, data, "chat", requests, answer, max_tokens, items_per_call=per_call)


__all__ = ["chat_requests", "label_chat", "REQUESTS_FILE"]
