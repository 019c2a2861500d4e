"""Peers in the same bench run: what a user would run instead of Foresight, on the same prompts.

`--peers hf` adds transformers' own `generate` on the same target, dtype and device, plain and with its
prompt-lookup decoding (`prompt_lookup_num_tokens`), each with as many CPU threads as Foresight's two
workers use together and with one thread. `--peers llamacpp` adds llama.cpp (bench/llamacpp_peer.py) on the
target's GGUF file, as shipped and rewritten as BF16, with the same two thread counts. A peer runs inside the
bench process, after the engine's modes on the same prompt (the workers sit idle in a blocking poll
meanwhile), so drift of a noisy machine hits peers and modes alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import ConfigError, EngineConfig
from ..models.compiled_step import intra_op_threads
from ..protocol.messages import GenerateRequest
from ..models.loading import load_target, resolve_dtype, resolve_target
from ..target_worker.steps import eos_ids

PEER_KINDS = ("hf", "llamacpp")
# Draft length of transformers' prompt lookup: short, as suits a small target whose verify cost grows
# with its length (not tuned per run).
PROMPT_LOOKUP_TOKENS = 3


@dataclass(frozen=True)
class Peer:
    name: str  # e.g. "hf@2t", "hf-pld@1t", "llamacpp-bf16@1t"
    threads: int
    prompt_lookup: int | None = None  # hf: prompt_lookup_num_tokens, None = plain decoding
    kind: str = "hf"  # the engine that runs it, one of PEER_KINDS
    bf16: bool = False  # llamacpp: the GGUF rewritten as BF16 instead of as shipped


def plan_peers(spec: str, cfg: EngineConfig) -> list[Peer]:
    """Each kind's peers, with the workers' total thread count and with one thread: `hf` -> plain and
    prompt-lookup generate, `llamacpp` -> llama.cpp on the GGUF as shipped and as BF16."""
    kinds = list(dict.fromkeys(k.strip() for k in spec.split(",") if k.strip()))
    bad = [k for k in kinds if k not in PEER_KINDS]
    if bad:
        raise ConfigError(f"peers: unknown peer(s) {bad}; choose from {', '.join(PEER_KINDS)}")
    total = cfg.target_threads + cfg.drafter_threads
    counts = list(dict.fromkeys([total, 1]))
    planned = []
    for kind in kinds:
        if kind == "hf":
            planned += [Peer(f"hf{'-pld' if pld else ''}@{n}t", n, pld)
                        for pld in (None, PROMPT_LOOKUP_TOKENS) for n in counts]
        else:
            planned += [Peer(f"llamacpp{'-bf16' if bf16 else ''}@{n}t", n, kind="llamacpp", bf16=bf16)
                        for bf16 in (False, True) for n in counts]
    return planned


@dataclass
class PeerTally:
    output_tokens: int = 0
    wall_s: float = 0.0
    outputs: list[list[int]] | None = None

    def summary(self, ar_outputs: list[list[int]] | None, threads: int) -> dict:
        outputs = self.outputs or []
        match = None
        if ar_outputs is not None:
            match = sum(a == b for a, b in zip(ar_outputs, outputs)) / max(len(outputs), 1)
        return {"tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else None,
                "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 3), "threads": threads,
                "outputs_match_ar": match}


def peer_section(peers: list[Peer], tallies: dict[str, PeerTally], ar_outputs: list[list[int]] | None,
                 modes: dict) -> dict:
    """peers.<name>: speed, threads, outputs_match_ar, and every mode's speed against the peer."""
    out = {}
    for peer in peers:
        s = tallies[peer.name].summary(ar_outputs, peer.threads)
        s["modes_vs_peer"] = {m: v["tokens_per_s"] / s["tokens_per_s"]
                              if v.get("tokens_per_s") and s["tokens_per_s"] else None
                              for m, v in modes.items()}
        out[peer.name] = s
    return out


class PeerGroup:
    """The peers of one engine, one request at a time; a subclass runs one (`run`) and counts it (`count`)."""

    peers: list[Peer]
    tallies: dict[str, PeerTally]

    def run(self, peer: Peer, request: GenerateRequest, tally: PeerTally | None = None) -> None:
        raise NotImplementedError

    def run_all(self, request: GenerateRequest) -> None:
        for peer in self.peers:
            self.run(peer, request)

    def warm_up(self, request: GenerateRequest) -> None:
        """Each peer once on `request`, not counted (as the modes' warm-up: first calls pay one-off costs)."""
        for peer in self.peers:
            self.run(peer, request, PeerTally(outputs=[]))

    def count(self, peer: Peer, tally: PeerTally | None, tokens: list[int], elapsed: float) -> None:
        """One request's output and time, in `tally` (default: the peer's own)."""
        tally = tally if tally is not None else self.tallies[peer.name]
        tally.wall_s += elapsed
        tally.output_tokens += len(tokens)
        tally.outputs.append(tokens)


class HfPeers(PeerGroup):
    """transformers' generate for each planned peer, one request at a time."""

    def __init__(self, cfg: EngineConfig, peers: list[Peer]):
        self.peers = peers
        dtype = resolve_dtype(cfg.dtype, cfg.target_device)
        self.model = load_target(resolve_target(cfg.target), dtype, cfg.target_device)
        self.eos = eos_ids(self.model)  # the stop tokens the target worker uses
        self.device = cfg.target_device
        self.tallies = {p.name: PeerTally(outputs=[]) for p in peers}

    @torch.inference_mode()
    def run(self, peer: Peer, request: GenerateRequest, tally: PeerTally | None = None) -> None:
        """`peer` on `request`, counted in `tally` (default: the peer's own)."""
        with intra_op_threads(peer.threads):
            t0 = time.perf_counter()
            tokens = self._generate(peer, request)
            elapsed = time.perf_counter() - t0
        self.count(peer, tally, tokens, elapsed)

    def _generate(self, peer: Peer, request: GenerateRequest) -> list[int]:
        s = request.sampling
        ids = torch.tensor([request.prompt_ids], device=self.device)  # [1, prompt]
        kwargs = dict(max_new_tokens=request.max_tokens, do_sample=s.temperature > 0,
                      eos_token_id=[*self.eos, *request.stop_token_ids],  # bench requests never ignore eos
                      pad_token_id=self.eos[0])
        if s.temperature > 0:
            torch.manual_seed(s.seed if s.seed is not None else 0)
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if peer.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = peer.prompt_lookup
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def section(self, ar_outputs: list[list[int]] | None, modes: dict) -> dict:
        """peers.<name>: speed, threads, outputs_match_ar, and every mode's speed against the peer."""
        return peer_section(self.peers, self.tallies, ar_outputs, modes)


class PeerGroups:
    """Every planned kind's peers behind one warm_up / run_all / section interface, kind after kind."""

    def __init__(self, groups: list):
        self.groups = groups  # HfPeers, LlamaCppPeers

    def warm_up(self, request: GenerateRequest) -> None:
        for group in self.groups:
            group.warm_up(request)

    def run_all(self, request: GenerateRequest) -> None:
        for group in self.groups:
            group.run_all(request)

    def section(self, ar_outputs: list[list[int]] | None, modes: dict) -> dict:
        return {name: s for group in self.groups for name, s in group.section(ar_outputs, modes).items()}


def open_peers(cfg: EngineConfig, peers: list[Peer]) -> PeerGroups | None:
    """The planned peers loaded, one group per kind; None when none is planned."""
    groups = []
    hf = [p for p in peers if p.kind == "hf"]
    if hf:
        groups.append(HfPeers(cfg, hf))
    llama = [p for p in peers if p.kind == "llamacpp"]
    if llama:
        from .llamacpp_peer import LlamaCppPeers  # here: that module imports this one

        groups.append(LlamaCppPeers(cfg, llama))
    return PeerGroups(groups) if groups else None
