"""Labelled chat sequences kept in the repository as compressed token-id shards (append-only).

    data/chat/manifest.json    the shards (file, sequences, tokens, kinds, sha256), the runs (settings, tokens/s)
                               and the plan items done, as ranges [lo, hi)
    data/chat/shard-NNNNN.npz  tokens uint16 [N], offsets int64 [S + 1] (sequence s is tokens[offsets[s]:offsets[s+1]]),
                               sampled bool [S] (answered at T > 0), kind int16 [S] (index into the manifest's kinds)
    data/chat/README.md        the data card, written from the manifest

A finished item goes at once to a pending file outside the repository (one JSON line, flushed); `pack` turns the
pending items into one new shard (written under a temporary name, then renamed) and records them in the manifest.
So a run that is killed loses only the requests in flight: the next one packs what is pending, then continues after
the items done. A shard, once written, is never rewritten (git history stays the size of the data).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
CARD = "README.md"
MAX_TOKEN_ID = 2**16 - 1  # uint16 shards


class LabelStore:
    def __init__(self, folder: Path, pending: Path):
        """`folder`: the shards (in the repository); `pending`: the items finished and not packed yet (a file
        outside the repository)."""
        self.folder = Path(folder)
        self.pending = Path(pending)
        self.manifest = self._read_manifest()

    def _read_manifest(self) -> dict:
        path = self.folder / MANIFEST
        if path.is_file():
            return json.loads(path.read_text())
        return {"format": "foresight-chat-labels", "kinds": [], "shards": [], "runs": [], "done": []}

    def done(self) -> set[int]:
        """Plan items finished: packed or pending (answered or dropped)."""
        items = {i for lo, hi in self.manifest["done"] for i in range(lo, hi)}
        return items | {record["item"] for record in self.pending_records()}

    def pending_records(self) -> list[dict]:
        if not self.pending.is_file():
            return []
        records = []
        for line in self.pending.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short by a kill: that item was in flight
                continue
        return records

    def add(self, record: dict) -> None:
        """One finished item: {"item", "tokens" (None when dropped), "kind", "sampled", "dropped" (a reason or
        None)}."""
        self.pending.parent.mkdir(parents=True, exist_ok=True)
        with open(self.pending, "a") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()

    def pack(self, run: dict | None = None) -> dict | None:
        """The pending items into one new shard (and the manifest); `run`: this run's summary to record. Returns
        the shard's manifest entry (None: nothing to pack)."""
        records = self.pending_records()
        kept = [r for r in records if r.get("tokens")]
        entry = self._write_shard(kept) if kept else None
        self.manifest["done"] = merged_ranges(self.manifest["done"], [r["item"] for r in records])
        if run is not None:
            self.manifest["runs"].append(run)
        if entry is not None or run is not None or records:
            self._write_manifest()
            self.pending.unlink(missing_ok=True)
        return entry

    def _write_shard(self, records: list[dict]) -> dict:
        kinds = self.manifest["kinds"]
        for r in records:
            if r["kind"] not in kinds:
                kinds.append(r["kind"])
        lengths = [len(r["tokens"]) for r in records]
        tokens = np.fromiter((t for r in records for t in r["tokens"]), dtype=np.int64, count=sum(lengths))
        if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_TOKEN_ID):
            raise ValueError("token ids beyond uint16: this store holds vocabularies of up to 65536 tokens")
        name = f"shard-{len(self.manifest['shards']):05d}.npz"
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (name + ".partial")
        with open(partial, "wb") as out:
            np.savez_compressed(out, tokens=tokens.astype(np.uint16),
                                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                                sampled=np.array([bool(r["sampled"]) for r in records]),
                                kind=np.array([kinds.index(r["kind"]) for r in records], dtype=np.int16))
        partial.replace(self.folder / name)
        counts: dict[str, int] = {}
        for r in records:
            counts[r["kind"]] = counts.get(r["kind"], 0) + len(r["tokens"])
        entry = {"file": name, "sequences": len(records), "tokens": int(sum(lengths)), "tokens_by_kind": counts,
                 "sha256": hashlib.sha256((self.folder / name).read_bytes()).hexdigest(),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.manifest["shards"].append(entry)
        return entry

    def _write_manifest(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1) + "\n")
        tmp.replace(self.folder / MANIFEST)
        (self.folder / CARD).write_text(data_card(self.manifest, self.folder))

    def sequences(self) -> list[list[int]]:
        """Every packed sequence, shard by shard."""
        return packed_sequences(self.folder)


def packed_sequences(folder: Path) -> list[list[int]]:
    """Every sequence of the shards in `folder`, in manifest order: shards are only ever appended, so a sequence
    keeps its index from run to run (a teacher-forcing pass over them resumes by index)."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    out = []
    for shard in manifest["shards"]:
        data = np.load(Path(folder) / shard["file"])
        tokens, offsets = data["tokens"], data["offsets"]
        out += [tokens[offsets[s]:offsets[s + 1]].astype(np.int64).tolist() for s in range(len(offsets) - 1)]
    return out


def merged_ranges(ranges: list[list[int]], items: list[int]) -> list[list[int]]:
    """`ranges` ([lo, hi) each) with `items` added, merged and sorted."""
    points = sorted({i for lo, hi in ranges for i in range(lo, hi)} | set(items))
    out: list[list[int]] = []
    for i in points:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def data_card(manifest: dict, folder: Path) -> str:
    """The data card: what the shards hold, how they were made, how much."""
    tokens = sum(s["tokens"] for s in manifest["shards"])
    sequences = sum(s["sequences"] for s in manifest["shards"])
    size = sum((folder / s["file"]).stat().st_size for s in manifest["shards"] if (folder / s["file"]).is_file())
    by_kind: dict[str, int] = {}
    for shard in manifest["shards"]:
        for kind, count in shard["tokens_by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + count
    lines = ["# Chat labels: the target's own answers, as token ids", "",
             "Written by `foresight train label` (foresight/training/engine_labels.py; format in "
             "foresight/training/label_store.py). Each sequence is a whole conversation in the target's chat template: "
             "requests from the seeded self-instruct plan (templates, or written by the target at T=0.8), answered by "
             "a running `foresight serve` (greedy and T=0.8 in turn), a planned follow-up turn answered after the "
             "first. Every request and answer was checked against the evaluation sets in the repository (HumanEval and "
             "the chat set: no shared 13-gram of words, no whole short evaluation request) before it was kept.", "",
             f"- sequences: {sequences}", f"- tokens: {tokens}", f"- shards: {len(manifest['shards'])}, "
             f"{size / 2**20:.2f} MiB ({size} bytes)", f"- plan items done (answered or dropped): "
             f"{sum(hi - lo for lo, hi in manifest['done'])}", "", "| kind | tokens |", "| --- | --- |"]
    lines += [f"| {kind} | {count} |" for kind, count in sorted(by_kind.items())]
    lines += ["", "Runs (labelled tokens per second: the answers' completion tokens over the run's wall time):", "",
              "| started | machine | server | items | completion tokens | tokens/s |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['started']} | {r['machine']} | {r['server']} | {r['items']} | {r['completion_tokens']} | "
              f"{r['tokens_per_s']:.1f} |" for r in manifest["runs"]]
    return "\n".join(lines) + "\n"
