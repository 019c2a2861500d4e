"""Label training sequences with the target, once: per token its hidden states and next-token top-k.

Data dir (default ~/.cache/foresight/train/<target>-<layers>-k<k>/, never in git):
    meta.json                      target, layers, k, and per stream the items done and its shards
    shards_chat_00000.safetensors  the repository's token-id shards (data/chat) teacher-forced (label_shards)
    text_00000.safetensors ...     teacher-forced stdlib conversations
    regen_00000.safetensors ...    the target's own answers to prompts built from the same text (optional)
Each shard holds whole sequences:
    tokens [N] int32, offsets [S+1] int64, hidden [N, n_layers * H] fp16, topk_ids [N, k] int32,
    topk_logp [N, k] fp16 (log-softmax of the target's logits; row t is the law of token t+1).
Labelling is resumable: the item order is fixed by the seed, a shard is written atomically, and
meta.json records how many items are done.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .corpus import Conversation

FP16_MAX = 65000.0
META = "meta.json"


@dataclass(slots=True)
class LabelSettings:
    layers: list[int]
    topk: int = 32
    max_len: int = 1024  # longer sequences are truncated
    min_len: int = 24  # shorter ones are skipped (need at least one block after the anchor)
    shard_tokens: int = 16384
    batch_size: int = 1  # sequences per teacher-forced pass
    regen_batch: int = 0  # prompts per generate call (0: batch_size); on a GPU generation wants far more
    regen_max_new: int = 256
    deadline: float = 0.0  # time.monotonic() after which no new call starts (0 = none); see label_stream


class Labeller:
    """Teacher-forces the target over token sequences."""

    def __init__(self, model, settings: LabelSettings):
        self.model = model
        self.s = settings
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def label(self, seqs: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """One padded forward over a batch of sequences -> per sequence its label tensors (CPU)."""
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: real positions keep positions 0..len-1
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        # No cache: one pass, nothing to continue (a hybrid target would also build its recurrent states).
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         output_hidden_states=self.s.layers, logits_to_keep=0, use_cache=False)
        hidden = torch.cat([out.hidden_states[i].float() for i in self.s.layers], dim=-1)  # [B, n, F]
        hidden = hidden.clamp(-FP16_MAX, FP16_MAX).half().cpu()
        logp, top = torch.log_softmax(out.logits.float(), dim=-1).topk(self.s.topk, dim=-1)  # [B, n, k]
        logp, top = logp.half().cpu(), top.int().cpu()
        return [{"tokens": torch.tensor(s, dtype=torch.int32), "hidden": hidden[i, :len(s)],
                 "topk_ids": top[i, :len(s)], "topk_logp": logp[i, :len(s)]} for i, s in enumerate(seqs)]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sample: bool, seed: int, eos: list[int], temperature: float = 0.8,
                 top_p: float | None = None, max_new: int | None = None) -> list[list[int]]:
        """The target's own answers (greedy, or sampled at `temperature`), appended to their prompts."""
        n = max(len(p) for p in prompts)
        pad = eos[0] if eos else 0
        ids = torch.full((len(prompts), n), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), n, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding for generation
            ids[i, n - len(p):] = torch.tensor(p)
            mask[i, n - len(p):] = 1
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new or self.s.regen_max_new, do_sample=sample,
                                  temperature=temperature if sample else None, top_p=top_p if sample else None,
                                  top_k=None, pad_token_id=pad, eos_token_id=eos or None)
        seqs = []
        for i, p in enumerate(prompts):
            new = out[i, n:].tolist()
            for j, t in enumerate(new):
                if t in eos:
                    new = new[:j + 1]
                    break
            seqs.append(p + new)
        return seqs


class DataDir:
    """meta.json + shards; appends shards atomically."""

    def __init__(self, path: Path, header: dict):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        meta_path = self.path / META
        if meta_path.is_file():
            self.meta = json.loads(meta_path.read_text())
            for key, value in header.items():
                if self.meta.get(key) != value:
                    raise ValueError(f"data dir {self.path} was labelled with {key}={self.meta.get(key)!r}, "
                                     f"not {value!r}; use another --data-dir")
        else:
            self.meta = dict(header, streams={})
            self.save_meta()

    def stream(self, name: str) -> dict:
        return self.meta["streams"].setdefault(name, {"items_done": 0, "sequences": 0, "tokens": 0, "shards": []})

    def save_meta(self) -> None:
        tmp = self.path / (META + ".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.path / META)

    def write_shard(self, name: str, records: list[dict], items_done: int) -> None:
        st = self.stream(name)
        fname = f"{name}_{len(st['shards']):05d}.safetensors"
        lengths = torch.tensor([0] + [len(r["tokens"]) for r in records], dtype=torch.int64)
        tensors = {"tokens": torch.cat([r["tokens"] for r in records]), "offsets": lengths.cumsum(0),
                   "hidden": torch.cat([r["hidden"] for r in records]),
                   "topk_ids": torch.cat([r["topk_ids"] for r in records]),
                   "topk_logp": torch.cat([r["topk_logp"] for r in records])}
        tmp = self.path / (fname + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(self.path / fname)
        st["shards"].append(fname)
        st["items_done"] = items_done
        st["sequences"] += len(records)
        st["tokens"] += int(lengths.sum())
        self.save_meta()


def label_stream(labeller: Labeller, data: DataDir, name: str, items: list, to_ids: Callable[[list, int], list[list[int]]],
                 max_tokens: int | None, max_items: int | None = None, items_per_call: int = 0) -> None:
    """Label `items` in order (resuming after meta's items_done) until the stream holds `max_tokens`
    tokens or `max_items` items. `to_ids(batch, index of its first item)` gives the token sequences of
    `items_per_call` items (default: the labelling batch); they are labelled a batch at a time."""
    st = data.stream(name)
    limit = len(items) if max_items is None else min(len(items), max_items)
    bar = tqdm(total=max_tokens, initial=st["tokens"], unit="tok", desc=f"label {name}", dynamic_ncols=True)
    max_tokens = max_tokens or 2**62
    if st["tokens"] >= max_tokens or st["items_done"] >= limit:
        bar.close()
        return
    s = labeller.s
    pending: list[dict] = []
    pending_tokens = 0
    i = st["items_done"]
    last_call_s = 0.0
    while i < limit and st["tokens"] + pending_tokens < max_tokens:
        if s.deadline and time.monotonic() + last_call_s > s.deadline:
            # The next call would not finish in time: stop with everything labelled so far written
            # (a process killed mid-call loses the call; on the H200 one call of 1,024 answers is ~1 min).
            if pending:
                data.write_shard(name, pending, i)
            break
        started = time.monotonic()
        batch = items[i:min(i + (items_per_call or s.batch_size), limit)]
        seqs = [q[:s.max_len] for q in to_ids(batch, i)]
        i += len(batch)
        seqs = [q for q in seqs if len(q) >= s.min_len]
        if seqs:
            for at in range(0, len(seqs), s.batch_size):
                pending += labeller.label(seqs[at:at + s.batch_size])
            added = sum(len(q) for q in seqs)
            pending_tokens += added
            bar.update(added)
        if pending_tokens >= s.shard_tokens or i >= limit or st["tokens"] + pending_tokens >= max_tokens:
            if pending:
                data.write_shard(name, pending, i)
            pending, pending_tokens = [], 0
        last_call_s = time.monotonic() - started
    bar.close()


def label_shards(labeller: Labeller, data: DataDir, folder: Path) -> None:
    """Teacher-force the target over every sequence of the token-id shards in `folder` (label_store.py), in their
    append-only order: a later run labels only the sequences added since (and what a killed run left)."""
    from .label_store import packed_sequences

    label_stream(labeller, data, f"shards_{Path(folder).name}", packed_sequences(Path(folder)),
                 lambda batch, _: batch, max_tokens=None)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids)


def label_all(labeller: Labeller, data: DataDir, convs: list[Conversation], encode: Callable[[list[dict], bool], list[int]],
              text_tokens: int, regen_items: int, eos: list[int], seed: int) -> None:
    """The text stream (teacher-forced conversations), then the regen stream (the target's own answers
    to the `implement` prompts, alternating greedy and sampled)."""
    if text_tokens > 0:
        label_stream(labeller, data, "text", convs, lambda b, _: [encode(c.messages, False) for c in b], text_tokens)
    if regen_items <= 0:
        return
    prompts = [c.messages[:-1] for c in convs if c.kind == "implement"]
    prompts = prompts[::-1]  # from the other end of the shuffled list: mostly text the text stream did not use

    per_call = labeller.s.regen_batch or labeller.s.batch_size

    def regen(batch: list, first: int) -> list[list[int]]:
        sample = (first // per_call) % 2 == 1  # alternate greedy and sampled batches
        return labeller.generate([encode(m, True) for m in batch], sample, seed + first, eos)

    label_stream(labeller, data, "regen", prompts, regen, max_tokens=None, max_items=regen_items, items_per_call=per_call)


def iter_shards(path: Path) -> Iterator[Path]:
    meta = json.loads((Path(path) / META).read_text())
    for st in meta["streams"].values():
        for fname in st["shards"]:
            yield Path(path) / fname
