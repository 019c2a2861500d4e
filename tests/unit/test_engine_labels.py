"""Labelling through the serving engine (training/engine_labels.py) into token-id shards (training/label_store.py),
against a scripted server (httpx.MockTransport): requests written and answered as the plan says, evaluation overlaps
dropped, shards that read back, a run that resumes after the items done and loses only what was in flight."""
from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from foresight.training.corpus import Decontaminator
from foresight.training.engine_labels import PLAN_SIZE, EngineLabeller, label_items
from foresight.training.label_store import LabelStore, merged_ranges
from foresight.training.self_instruct import plan

EVAL = ["Write a function that returns the sum of two numbers and prints it twice to the screen for me"]


def server(calls: list[dict]):
    """A scripted OpenAI-style server: written requests are a fixed question, answers count their turn."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append({"path": request.url.path, **body})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"text": "\nHow do I keep basil alive on a windowsill?"}]})
        turns = sum(m["role"] == "user" for m in body["messages"])
        text = "A short passage. " * 12 if "paragraph" in body["messages"][-1]["content"] else f"answer {turns}"
        return httpx.Response(200, json={"choices": [{"message": {"content": text}}],
                                         "usage": {"completion_tokens": 3}})
    return httpx.MockTransport(handle)


def encode(messages: list[dict]) -> list[int]:
    return [len(m["content"]) % 1000 for m in messages] + [7]


async def run(store: LabelStore, calls: list[dict], **kw) -> dict:
    async with httpx.AsyncClient(transport=server(calls)) as client:
        labeller = EngineLabeller(client, "http://x", "m", encode, Decontaminator(EVAL), seed=0)
        return await label_items(labeller, store, concurrency=4, log=lambda *a, **k: None, **kw)


def test_items_are_answered_as_planned_and_packed_into_shards(tmp_path):
    store = LabelStore(tmp_path / "chat", tmp_path / "pending.jsonl")
    calls: list[dict] = []
    counts = asyncio.run(run(store, calls, max_items=12))
    store.pack({"started": "t", "machine": "m", "server": "s", "items": 12, "completion_tokens": 1,
                "tokens_per_s": 1.0})
    items = plan(PLAN_SIZE, 0)[:12]
    assert counts["items"] == 12 and counts["failed"] == 0
    answers = [c for c in calls if c["path"] == "/v1/chat/completions" and c["max_tokens"] in (256, 160)
               and "paragraph" not in c["messages"][-1]["content"]]
    assert {c["temperature"] for c in answers} == {0.0, 0.8}  # greedy and sampled items in turn
    follow_ups = [c for c in answers if sum(m["role"] == "user" for m in c["messages"]) == 2]
    assert len(follow_ups) == sum(1 for it in items if it["follow_up"]) > 0
    manifest = json.loads((tmp_path / "chat" / "manifest.json").read_text())
    assert manifest["done"] == [[0, 12]] and len(manifest["runs"]) == 1
    shard = np.load(tmp_path / "chat" / manifest["shards"][0]["file"])
    assert shard["tokens"].dtype == np.uint16 and len(shard["offsets"]) == counts["kept"] + 1
    assert all(seq[-1] == 7 for seq in store.sequences()) and len(store.sequences()) == counts["kept"]
    assert "| kind | tokens |" in (tmp_path / "chat" / "README.md").read_text()


def test_a_request_overlapping_an_evaluation_set_is_dropped_unanswered(tmp_path):
    store = LabelStore(tmp_path / "chat", tmp_path / "pending.jsonl")
    calls: list[dict] = []
    labeller_items = plan(PLAN_SIZE, 0)
    item = dict(labeller_items[0], source="template", kind="code",
                template="Please: write a function that returns the sum of two numbers and prints it twice to the "
                         "screen for me now.", follow_up=None)

    async def one():
        async with httpx.AsyncClient(transport=server(calls)) as client:
            labeller = EngineLabeller(client, "http://x", "m", encode, Decontaminator(EVAL), seed=0)
            return await labeller.label(0, item)

    record = asyncio.run(one())
    assert record["dropped"] == "eval_overlap" and record["tokens"] is None and calls == []


def test_a_killed_run_keeps_what_finished_and_the_next_run_goes_on(tmp_path):
    """Finished items wait in the pending file; the next run packs them first and labels only the rest."""
    pending = tmp_path / "pending.jsonl"
    store = LabelStore(tmp_path / "chat", pending)
    asyncio.run(run(store, [], max_items=5))  # no pack: as if killed after these finished
    with open(pending, "a") as out:
        out.write('{"item": 99, "tok')  # a line cut short by the kill
    again = LabelStore(tmp_path / "chat", pending)
    assert again.done() == set(range(5))
    again.pack()
    calls: list[dict] = []
    asyncio.run(run(again, calls, max_items=3))
    again.pack()
    assert again.manifest["done"] == [[0, 8]] and len(again.manifest["shards"]) == 2
    first_shard = (tmp_path / "chat" / again.manifest["shards"][0]["file"]).read_bytes()
    again.pack()
    assert (tmp_path / "chat" / again.manifest["shards"][0]["file"]).read_bytes() == first_shard  # never rewritten


def test_failing_requests_stop_the_run_and_are_not_recorded(tmp_path):
    store = LabelStore(tmp_path / "chat", tmp_path / "pending.jsonl")

    async def failing():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503))) as client:
            labeller = EngineLabeller(client, "http://x", "m", encode, Decontaminator(EVAL), seed=0)
            return await label_items(labeller, store, concurrency=4, log=lambda *a, **k: None)

    counts = asyncio.run(failing())
    assert counts["items"] == 0 and 8 < counts["failed"] <= 8 + 1 + 4 and store.done() == set()


def test_ranges_merge_and_ids_beyond_uint16_are_refused(tmp_path):
    assert merged_ranges([[0, 3], [5, 6]], [3, 4, 9]) == [[0, 6], [9, 10]]
    store = LabelStore(tmp_path / "chat", tmp_path / "pending.jsonl")
    store.add({"item": 0, "tokens": [5, 70000], "kind": "k", "sampled": False, "dropped": None})
    with pytest.raises(ValueError, match="uint16"):
        store.pack()
