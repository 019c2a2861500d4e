"""`foresight train label`: the target's own chat answers, written by the serving engine under concurrent requests
and kept as token-id shards in the repository (label_store.py), for training the draft model.

    foresight train label [--out data/chat] [--url URL] [--concurrency 16] [--time-budget S] [--items N] [--seed S]

Without --url it starts `foresight serve` with the given engine flags (default: the embedded default, `--mode
auto`) and stops it at the end. Items come from the seeded self-instruct plan (self_instruct.py), in order, skipping
those done in earlier runs: a template, or a request the target writes at T=0.8 (continuing a list of user messages
through the completions endpoint, or a passage through the chat endpoint). A request that overlaps an evaluation
set (corpus.Decontaminator: a shared 13-gram of words or a whole short evaluation request) is dropped before it is
answered; the answer is checked too. Even items are answered greedily, odd ones at T=0.8, and a planned follow-up
turn is answered after the first. A kept sequence is the whole conversation in the chat template, tokenized here
(the API returns text, so the answers are re-tokenized: the canonical tokens of the text the target wrote).
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

from .corpus import Decontaminator, chat_eval_texts, eval_texts
from .label_store import LabelStore
from .labelling import chat_ids
from .self_instruct import clean_written, plan, request_from, writer_messages

PLAN_SIZE = 100_000  # the plan is drawn at this size whatever a run labels, so its order never changes
SHARD_ITEMS = 256  # finished items per shard: a long run packs as it goes
MAX_FAILURES = 8  # items failing (HTTP errors, a dead server) beyond the items finished: the run stops
SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 0.8, 0.95
WRITE_MAX = {"written": 48, "passage": 160}
ANSWER_MAX, FOLLOW_UP_MAX = 256, 160

Encode = Callable[[list[dict]], list[int]]


class EngineLabeller:
    """Labels plan items through a running server at `base`."""

    def __init__(self, client: httpx.AsyncClient, base: str, model: str, encode: Encode,
                 decontaminator: Decontaminator, seed: int):
        self.client, self.base, self.model = client, base, model
        self.encode = encode
        self.decontaminator = decontaminator
        self.seed = seed

    async def label(self, index: int, item: dict) -> dict:
        """The record of plan item `index`: its conversation's tokens, or why it was dropped."""
        written = None
        if item["source"] != "template":
            raw = await self.write(index, item)
            written = clean_written(raw, passage=item["source"] == "passage")
        request = request_from(item, written)
        if request is None:
            return dropped(index, item, "unusable")
        if not self.decontaminator.clean(request.messages[-1]["content"] + "\n" + (request.follow_up or "")):
            return dropped(index, item, "eval_overlap")
        sampled = index % 2 == 1
        messages = list(request.messages)
        answer, completion = await self.answer(messages, sampled, self.seed + index, ANSWER_MAX)
        messages.append({"role": "assistant", "content": answer})
        if request.follow_up:
            messages.append({"role": "user", "content": request.follow_up})
            second, more = await self.answer(messages, sampled, self.seed + PLAN_SIZE + index, FOLLOW_UP_MAX)
            messages.append({"role": "assistant", "content": second})
            completion += more
        if not self.decontaminator.clean("\n".join(m["content"] for m in messages if m["role"] == "assistant")):
            return dropped(index, item, "eval_overlap")
        return {"item": index, "tokens": self.encode(messages), "kind": item["kind"], "sampled": sampled,
                "dropped": None, "completion_tokens": completion}

    async def write(self, index: int, item: dict) -> str:
        """The target's text for an item's request (a written request) or passage."""
        what = writer_messages(item)
        body = {"model": self.model, "max_tokens": WRITE_MAX[item["source"]], "temperature": SAMPLE_TEMPERATURE,
                "top_p": SAMPLE_TOP_P, "seed": self.seed + 2 * PLAN_SIZE + index}
        if isinstance(what, str):
            out = await self.post("/v1/completions", {**body, "prompt": what})
            return out["choices"][0]["text"]
        out = await self.post("/v1/chat/completions", {**body, "messages": what})
        return out["choices"][0]["message"]["content"] or ""

    async def answer(self, messages: list[dict], sampled: bool, seed: int, max_tokens: int) -> tuple[str, int]:
        """The target's answer to `messages` and its completion tokens."""
        sampling = {"temperature": SAMPLE_TEMPERATURE, "top_p": SAMPLE_TOP_P} if sampled else {"temperature": 0.0}
        out = await self.post("/v1/chat/completions", {"model": self.model, "messages": messages,
                                                       "max_tokens": max_tokens, "seed": seed, **sampling})
        return (out["choices"][0]["message"]["content"] or "").strip(), out["usage"]["completion_tokens"]

    async def post(self, path: str, body: dict) -> dict:
        response = await self.client.post(self.base + path, json=body)
        response.raise_for_status()
        return response.json()


def dropped(index: int, item: dict, reason: str) -> dict:
    return {"item": index, "tokens": None, "kind": item["kind"], "sampled": False, "dropped": reason,
            "completion_tokens": 0}


async def label_items(labeller: EngineLabeller, store: LabelStore, concurrency: int, time_budget: float = 0.0,
                      max_items: int = 0, log=print) -> dict:
    """Label the plan's items not done yet, `concurrency` at a time, until `max_items` (0: no limit) finished or
    `time_budget` seconds (0: no limit) passed (then no new item starts; those running finish). Packs a shard every
    SHARD_ITEMS items. Returns this run's counts."""
    items = plan(PLAN_SIZE, labeller.seed)
    done = store.done()
    todo = (i for i in range(PLAN_SIZE) if i not in done)
    started = time.monotonic()
    counts = {"items": 0, "kept": 0, "dropped": 0, "failed": 0, "completion_tokens": 0}
    running: dict[asyncio.Task, int] = {}

    def stopping() -> bool:
        over_time = time_budget > 0 and time.monotonic() - started >= time_budget
        failing = counts["failed"] > MAX_FAILURES + counts["items"]
        return over_time or failing or (max_items > 0 and counts["items"] + len(running) >= max_items)

    while True:
        while len(running) < concurrency and not stopping():
            index = next(todo, None)
            if index is None:
                break
            running[asyncio.create_task(labeller.label(index, items[index]))] = index
        if not running:
            break
        finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            index = running.pop(task)
            if task.exception() is not None:  # not recorded: the next run tries it again
                counts["failed"] += 1
                log(f"[label] item {index} failed: {task.exception()!r}", file=sys.stderr)
                continue
            record = task.result()
            store.add(record)
            counts["items"] += 1
            counts["kept" if record["tokens"] else "dropped"] += 1
            counts["completion_tokens"] += record["completion_tokens"]
            if counts["items"] % SHARD_ITEMS == 0:
                store.pack()
                log(f"[label] {counts} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    counts["wall_s"] = time.monotonic() - started
    return counts


def run_summary(counts: dict, server: str, machine: dict) -> dict:
    """This run's line in the manifest (and the data card); `machine`: the bench's `machine_info`."""
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - counts["wall_s"])),
            "machine": f"{machine['cpu']}, {machine['cores']} cores", "server": server,
            "items": counts["items"], "kept": counts["kept"], "dropped": counts["dropped"],
            "completion_tokens": counts["completion_tokens"], "wall_s": round(counts["wall_s"], 1),
            "tokens_per_s": counts["completion_tokens"] / max(counts["wall_s"], 1e-9)}


async def label_with_server(args, cfg) -> dict:
    """`foresight train label`: label through --url, or through a server started here with the engine flags."""
    from transformers import AutoTokenizer

    from ..bench.harness import machine_info
    from ..bench.load import running_server
    from ..models.loading import cache_root, resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target))
    store = LabelStore(Path(args.out), cache_root() / "labels" / f"{Path(args.out).name}-pending.jsonl")
    store.pack()  # what a killed run left pending
    decontaminator = Decontaminator(eval_texts(), whole_short=chat_eval_texts())
    async with httpx.AsyncClient(timeout=600) as client:
        if args.url:
            counts = await label_at(client, args.url.rstrip("/"), store, tokenizer, decontaminator, args)
            server = args.url
        else:
            log_path = cache_root() / "labels" / "server.log"
            async with running_server(cfg, cfg.mode, log_path, [], client) as base:
                counts = await label_at(client, base, store, tokenizer, decontaminator, args)
            server = f"foresight serve --mode {cfg.mode} --dtype {cfg.dtype}"
    store.pack(run_summary(counts, server, machine_info(cfg)))
    return counts


async def label_at(client, base: str, store: LabelStore, tokenizer, decontaminator, args) -> dict:
    model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
    labeller = EngineLabeller(client, base, model, lambda messages: chat_ids(tokenizer, messages), decontaminator,
                              args.seed)
    try:
        return await label_items(labeller, store, args.concurrency, args.time_budget, args.items)
    finally:
        store.pack()  # interrupted too: what finished is kept
