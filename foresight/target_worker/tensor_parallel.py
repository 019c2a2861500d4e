"""A target split over several devices by tensor parallelism.

The target worker is rank 0 of a process group of `tensor_parallel_size` ranks. It starts the other ranks as child
processes the way torchrun does (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in their environment), and
every rank loads the target with transformers' tensor-parallel plan for its architecture (models/loading.py): each
holds its shard of the attention and MLP weights and its share of the KV heads, and every forward all-reduces across
the ranks. So every rank must run the same forwards on the same caches in the same order. Rank 0 runs the worker's
loop; `SplitRunner` broadcasts each runner call that runs or changes a cache (a typed message of protocol/messages.py,
msgpack over a gloo group: no pickle) before making it, and the other ranks (`follow`) make the same call on their own
runner. Logits and states come out whole on every rank; the other ranks drop theirs.

A split target runs its forwards eager, on dense weights and plain linear layers (config.py refuses the flags that
would change that). A rank that dies takes the worker down with it (`RankLost`): the api restarts the whole group.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import weakref
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, EngineConfig
from ..models.loading import load_target, resolve_dtype, resolve_target
from ..protocol.liveness import prepare_worker_process
from ..protocol.codec import decode, encode
from ..protocol.messages import (HiddenLayout, ShardCacheCopy, ShardCacheFree, ShardCacheNew, ShardForward,
                                 ShardRollback, ShardVerifyBatch, Shutdown)
from .runner import TargetRunner

log = logging.getLogger("foresight.tensor_parallel")

RANK_SETTINGS_ENV = "FORESIGHT_RANK_SETTINGS"  # JSON {"config": EngineConfig dict, "layout": HiddenLayout dict}
GROUP_TIMEOUT = timedelta(minutes=30)  # a collective of the forwards (and the model load's) at most
# The other ranks wait for rank 0's next call as long as the server idles; past this they fail, and the worker
# restarts the group when it next finds a rank gone.
COMMAND_TIMEOUT = timedelta(days=7)
STOP_GRACE_S = 10.0


class RankLost(BaseException):
    """A rank of the split target is gone: no forward can run, so the worker stops (not one request failing)."""


class CommandChannel:
    """Rank 0's runner calls to the other ranks: each message's codec frames, broadcast over a gloo group."""

    def __init__(self, group):
        self.group = group

    def send(self, msg) -> None:
        frames = [bytes(frame) for frame in encode(msg)]  # [kind, body]: these messages carry no tensors
        sizes = torch.tensor([len(frame) for frame in frames], dtype=torch.int64)  # [2]
        dist.broadcast(sizes, 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8), 0, group=self.group)

    def recv(self):
        sizes = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(sizes, 0, group=self.group)
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.group)
        data = payload.numpy().tobytes()
        return decode([data[:int(sizes[0])], data[int(sizes[0]):]])


class SplitRunner(TargetRunner):
    """Rank 0's runner: every call that runs or changes a cache is first sent to the other ranks. Caches are named
    to them by number; one that is garbage-collected here is freed there with the next call."""

    def __init__(self, model, layout: HiddenLayout | None, channel: CommandChannel, ranks: list[subprocess.Popen]):
        super().__init__(model, layout)
        self.channel = channel
        self.ranks = ranks
        self.cache_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.next_id = 0
        self.freed: list[int] = []  # caches gone here, not yet freed on the other ranks

    def _send(self, msg) -> None:
        lost = [rank for rank, proc in enumerate(self.ranks, start=1) if proc.poll() is not None]
        if lost:
            raise RankLost(f"tensor-parallel rank(s) {lost} exited")
        if self.freed:  # one list for the runner's life: the caches' finalizers hold its `append`
            freed = self.freed[:]
            self.freed.clear()
            self.channel.send(ShardCacheFree(caches=freed))
        self.channel.send(msg)

    def _name(self, cache) -> int:
        cache_id, self.next_id = self.next_id, self.next_id + 1
        self.cache_ids[cache] = cache_id
        weakref.finalize(cache, self.freed.append, cache_id)
        return cache_id

    def new_cache(self):
        cache = super().new_cache()
        self._send(ShardCacheNew(cache=self._name(cache)))
        return cache

    def copy_cache(self, cache):
        copied = super().copy_cache(cache)
        self._send(ShardCacheCopy(source=self.cache_ids[cache], cache=self._name(copied)))
        return copied

    def forward(self, cache, tokens: list[int], keep_logits: int | None = None, rollback: bool = False,
                argmax_only: bool = False):
        self._send(ShardForward(cache=self.cache_ids[cache], tokens=list(tokens), keep_logits=keep_logits,
                                rollback=rollback, argmax_only=argmax_only))
        return super().forward(cache, tokens, keep_logits, rollback, argmax_only)

    def verify_batch(self, caches, blocks: list[list[int]], chunk=None):
        chunk_cache, chunk_tokens = (self.cache_ids[chunk[0]], list(chunk[1])) if chunk else (None, [])
        self._send(ShardVerifyBatch(caches=[self.cache_ids[c] for c in caches], blocks=[list(b) for b in blocks],
                                    chunk_cache=chunk_cache, chunk_tokens=chunk_tokens))
        return super().verify_batch(caches, blocks, chunk)

    def rollback(self, cache, rejected: int, result) -> None:
        self._send(ShardRollback(cache=self.cache_ids[cache], rejected=rejected))
        super().rollback(cache, rejected, result)


class Follower:
    """A rank other than 0: makes rank 0's runner calls on its own runner, on its own caches, until Shutdown."""

    def __init__(self, runner: TargetRunner, channel: CommandChannel):
        # Rank 0 alone decides on the logits: the others keep no fp32 head (building theirs took part in the
        # gather of rank 0's), and their forwards make the same collectives without one.
        runner.head, runner.logit_precision = None, "model"
        self.runner = runner
        self.channel = channel
        self.caches: dict[int, object] = {}
        self.results: dict[int, object] = {}  # each cache's last forward (what its rollback reads)
        self.handlers = {ShardCacheNew: self.on_new, ShardCacheCopy: self.on_copy, ShardCacheFree: self.on_free,
                         ShardForward: self.on_forward, ShardVerifyBatch: self.on_verify_batch,
                         ShardRollback: self.on_rollback}

    def run(self) -> None:
        while not isinstance(msg := self.channel.recv(), Shutdown):
            try:
                self.handlers[type(msg)](msg)
            except Exception:  # rank 0 raised on the same call: its request fails, the group goes on
                log.exception("tensor-parallel rank %d: %s failed", dist.get_rank(), type(msg).__name__)

    def on_new(self, msg: ShardCacheNew) -> None:
        self.caches[msg.cache] = self.runner.new_cache()

    def on_copy(self, msg: ShardCacheCopy) -> None:
        self.caches[msg.cache] = self.runner.copy_cache(self.caches[msg.source])

    def on_free(self, msg: ShardCacheFree) -> None:
        for cache_id in msg.caches:
            self.caches.pop(cache_id, None)
            self.results.pop(cache_id, None)

    def on_forward(self, msg: ShardForward) -> None:
        self.results[msg.cache] = self.runner.forward(self.caches[msg.cache], msg.tokens, msg.keep_logits,
                                                      msg.rollback, msg.argmax_only)

    def on_verify_batch(self, msg: ShardVerifyBatch) -> None:
        chunk = (self.caches[msg.chunk_cache], msg.chunk_tokens) if msg.chunk_cache is not None else None
        results = self.runner.verify_batch([self.caches[c] for c in msg.caches], msg.blocks, chunk)
        named = msg.caches + ([msg.chunk_cache] if chunk else [])
        self.results.update(zip(named, results))

    def on_rollback(self, msg: ShardRollback) -> None:
        self.runner.rollback(self.caches[msg.cache], msg.rejected, self.results[msg.cache])


# ---------------------------------------------------------------- the group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(cfg: EngineConfig, rank: int, port: int) -> dict[str, str]:
    """What torchrun would set for `rank`; LOCAL_RANK is the index of its device (transformers binds that one)."""
    device = cfg.target_devices()[rank]
    index = device.partition(":")[2] or "0"
    return {"RANK": str(rank), "LOCAL_RANK": index if device != "cpu" else str(rank),
            "WORLD_SIZE": str(cfg.tensor_parallel_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def join_group(cfg: EngineConfig) -> CommandChannel:
    """This process into the target's process group (its rank from the environment); the channel of rank 0's calls."""
    rank = int(os.environ["RANK"])
    device = cfg.target_devices()[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=cfg.tensor_parallel_size, timeout=GROUP_TIMEOUT)
    return CommandChannel(dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT))


def load_shard(cfg: EngineConfig, path: Path):
    rank = int(os.environ["RANK"])
    return load_target(path, resolve_dtype(cfg.dtype, cfg.target_device), cfg.target_devices()[rank],
                       cfg.tensor_parallel_size)


def start_ranks(cfg: EngineConfig, layout: HiddenLayout, port: int) -> list[subprocess.Popen]:
    """Ranks 1.. as child processes of this one (rank 0), each running `follower_main`."""
    settings = json.dumps({"config": cfg.to_dict(), "layout": dataclasses.asdict(layout)}, default=str)
    ranks = []
    for rank in range(1, cfg.tensor_parallel_size):
        env = {**os.environ, **rank_environment(cfg, rank, port), RANK_SETTINGS_ENV: settings}
        ranks.append(subprocess.Popen([sys.executable, "-m", "foresight.target_worker.tensor_parallel"], env=env))
    return ranks


@contextmanager
def split_target(cfg: EngineConfig, path: Path, layout: HiddenLayout):
    """Rank 0 of a target split over `cfg.tensor_parallel_size` ranks: starts the others, loads its shard, yields
    its `SplitRunner`; on the way out stops the others (Shutdown, or killed when rank 0 leaves by an error)."""
    check_divides(cfg.tensor_parallel_size, path)
    port = free_port()
    environment = rank_environment(cfg, 0, port)
    before = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)  # read by transformers as it loads the shard
    ranks = start_ranks(cfg, layout, port)
    channel, clean = None, False
    try:
        channel = join_group(cfg)
        runner = SplitRunner(load_shard(cfg, path), layout, channel, ranks)
        log.info("target split over %d ranks (%s)", cfg.tensor_parallel_size, ", ".join(cfg.target_devices()))
        yield runner
        clean = True
    finally:
        stop_ranks(ranks, channel if clean and all(proc.poll() is None for proc in ranks) else None)
        restore_environment(before)


def restore_environment(before: dict[str, str | None]) -> None:
    """The variables of `before` back to its values (None: unset)."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def check_divides(size: int, path: Path) -> None:
    """Each rank takes an equal share of the attention and KV heads: `size` must divide both counts."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ConfigError(f"tensor_parallel_size {size} must divide the target's {heads} attention heads and "
                          f"{kv_heads} KV heads (each rank holds an equal share)")


def stop_ranks(ranks: list[subprocess.Popen], channel: CommandChannel | None) -> None:
    """Shutdown to the other ranks through `channel` (None: kill them), then wait for them to exit."""
    if channel is not None:
        channel.send(Shutdown())
    for proc in ranks:
        try:
            proc.wait(STOP_GRACE_S if channel is not None else 0.1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if dist.is_initialized():
        dist.destroy_process_group()


def follower_main() -> None:
    """Entry point of ranks 1.. (`python -m foresight.target_worker.tensor_parallel`, started by rank 0)."""
    prepare_worker_process()
    settings = json.loads(os.environ[RANK_SETTINGS_ENV])
    cfg = EngineConfig.from_dict(settings["config"])
    torch.set_num_threads(cfg.target_threads)
    channel = join_group(cfg)
    runner = TargetRunner(load_shard(cfg, resolve_target(cfg.target)), HiddenLayout(**settings["layout"]))
    Follower(runner, channel).run()
    dist.destroy_process_group()


if __name__ == "__main__":
    follower_main()
