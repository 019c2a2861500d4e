"""llama.cpp's own server as a peer in the load benchmark: `foresight bench --concurrency ... --peers llamacpp`.

Each planned peer (bench/peers.py: the target's GGUF as shipped, `llamacpp@Nt`, and rewritten as BF16,
`llamacpp-bf16@Nt`; under load only at N = the thread count of Foresight's two workers together) is an
`xllamacpp.Server` in the bench process, started fresh for each repeat beside the modes' servers: llama.cpp's
HTTP server on 127.0.0.1 (a free port, read back from `listening_address`) with as many slots as the highest
concurrency level (`n_parallel`), continuous batching, one KV stream per slot sized for the longest prompt
plus --max-tokens, and no prompt cache (Foresight has none: every request pays its prefill). The load
bench's own client (load.run_level / one_request) drives it like a mode's server, so its rows sit in the
same per-level table and `ratios_vs_ar` gives its tokens/s over `ar`'s.

Request: llama.cpp's `/v1/completions`, streamed with usage, with the modes' body (max_tokens, temperature,
seed, stream_options) but the prompt as the very token ids Foresight's server makes of the item (the
target's tokenizer and its chat template, as server/serving.py applies them), computed once before the
bench. (llama.cpp's `/v1/chat/completions` with the GGUF's own template gives the same ids on all 78 chat
prompts of the embedded default; ids leave no doubt, also for text prompts, and keep llama.cpp's templating
out of its TTFT while Foresight's server pays its own: a few ms.) Samplers as in the single-stream peer:
temperature, top_k, top_p only, at Foresight's request defaults (top_k 0, top_p 1), so that a temperature
above 0 samples the same distribution; at temperature 0 llama.cpp takes the argmax. Output tokens come
from the stream's usage (`completion_tokens`); llama.cpp stops at the GGUF's end-of-generation tokens (the
embedded default's <|im_end|> is the target's eos) and counts the one it stopped at.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import time
from pathlib import Path

from ..config import ConfigError, EngineConfig
from ..server.openai_schemas import ChatCompletionRequest, CompletionRequest
from ..server.serving import RequestRunner
from .llamacpp_peer import SAMPLERS, _xllamacpp, bf16_gguf, server_params, source_gguf
from .load import one_request, request_body
from .peers import Peer, plan_peers

# llama.cpp rounds context sizes to this; a multiple of it leaves each slot exactly the room asked for.
CTX_ROUND = 256
# HTTP threads beyond one per slot: the health check and warm-up arrive beside the streams.
SPARE_HTTP_THREADS = 4
ENDPOINT = "/v1/completions"  # what request_body gives a {'prompt'} item


def plan_load_peers(spec: str, cfg: EngineConfig) -> list[Peer]:
    """The llama.cpp peers of `spec` at the workers' total thread count: under load one thread count is
    enough (the one Foresight serves with), and only llama.cpp has a server to put under load."""
    planned = plan_peers(spec, cfg)
    others = sorted({p.kind for p in planned if p.kind != "llamacpp"})
    if others:
        raise ConfigError(f"peers: under --concurrency only llamacpp runs (its own HTTP server); "
                          f"{', '.join(others)} runs one request at a time: use it without --concurrency")
    total = cfg.target_threads + cfg.drafter_threads
    return [p for p in planned if p.threads == total]


def item_prompt_ids(tokenizer, item: dict) -> list[int]:
    """The prompt ids Foresight's server makes of a prompt item: server/serving.py's `prompt_ids` itself, on
    the body the bench builds of it (harness.build_requests)."""
    runner = RequestRunner(None, tokenizer, "llamacpp", max_model_len=1 << 30, max_prompt_chars=0)
    if "messages" in item:
        body = ChatCompletionRequest(messages=item["messages"])
    else:  # unvalidated: an empty prompt goes as the eos, as prompt_ids makes it, not as a schema error
        body = CompletionRequest.model_construct(prompt=item["prompt"])
    return runner.prompt_ids(body)[0]


def slot_context(prompt_ids: list[list[int]], max_tokens: int) -> int:
    """KV cells per slot: the longest prompt and its whole output, rounded up to CTX_ROUND."""
    need = max(len(ids) for ids in prompt_ids) + max_tokens + 1
    return -(-need // CTX_ROUND) * CTX_ROUND


def peer_body(ids: list[int], index: int, args: argparse.Namespace) -> tuple[str, dict]:
    """(path, body) for llama.cpp: the modes' request (load.request_body) with the prompt as token ids and
    llama.cpp's sampler chain narrowed to Foresight's (its defaults add min_p 0.05, top_k 40, top_p 0.95)."""
    path, body = request_body({"prompt": list(ids)}, index, args)
    body.update(samplers=SAMPLERS, top_k=0, top_p=1.0, cache_prompt=False)
    return path, body


def load_params(model: Path, threads: int, n_parallel: int, slot_ctx: int):
    """llamacpp_peer's server settings (threads, no prompt cache, quiet) for `n_parallel` streams at once."""
    p = server_params(model, threads)
    p.n_parallel = n_parallel
    p.cont_batching = True  # a slot's request joins the running batch at once, as Foresight's scheduler admits
    p.kv_unified = False  # one KV stream per slot: attention over its own cells, not over every slot's
    p.n_ctx = n_parallel * slot_ctx  # split evenly among the slots
    p.n_threads_http = n_parallel + SPARE_HTTP_THREADS  # each open stream holds an HTTP thread
    p.hostnames = ["127.0.0.1"]  # loopback only
    p.port = 0  # a free port, read back from the server
    return p


class LoadPeers:
    """The planned llama.cpp peers of one load bench: their GGUFs, the items' prompt ids, their servers."""

    def __init__(self, cfg: EngineConfig, peers: list[Peer], items: list[dict], n_parallel: int,
                 args: argparse.Namespace):
        self.peers = peers
        self.n_parallel = n_parallel
        self.models: dict[bool, Path] = {}
        self.ids: list[list[int]] = []
        self.load_s: dict[str, list[float]] = {p.name: [] for p in peers}
        if not peers:
            return
        _xllamacpp()  # a missing wheel fails before the BF16 rewrite and the tokenizer
        source = source_gguf(cfg)
        self.models = {False: source, True: bf16_gguf(source) if any(p.bf16 for p in peers) else None}
        from ..models.loading import load_tokenizer, resolve_target

        tokenizer = load_tokenizer(resolve_target(cfg.target))
        self.ids = [item_prompt_ids(tokenizer, item) for item in items]
        self.slot_ctx = slot_context(self.ids, args.max_tokens)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.peers]

    def body(self, item: dict, index: int, args: argparse.Namespace) -> tuple[str, dict]:
        """load.request_body's signature, for load.run_level: the item's precomputed prompt ids."""
        return peer_body(self.ids[index], index, args)

    def start(self, peer: Peer):
        """A fresh llama.cpp server for `peer` (blocks while it loads: well under a second here)."""
        t0 = time.perf_counter()
        server = _xllamacpp().Server(load_params(self.models[peer.bf16], peer.threads, self.n_parallel,
                                                 self.slot_ctx))
        self.load_s[peer.name].append(round(time.perf_counter() - t0, 3))
        return server

    @contextlib.asynccontextmanager
    async def serving(self, client, warm_up_index: int, args: argparse.Namespace, headers: dict):
        """Every peer's server up (fresh, as the modes' servers each repeat), each sent one warm-up request;
        yields {name: base URL}; always stops them."""
        servers = {}
        try:
            for peer in self.peers:
                servers[peer.name] = self.start(peer)
                base = servers[peer.name].listening_address
                warm = await one_request(client, base, *self.body({}, warm_up_index, args), headers)
                if warm.status != "ok":
                    print(f"[load] {peer.name}: the warm-up request failed: {warm.error}", flush=True)
            yield {name: server.listening_address for name, server in servers.items()}
        finally:
            servers.clear()  # an xllamacpp Server stops (HTTP listener, slots, threads) when freed
            gc.collect()

    def info(self) -> dict:
        """settings.peers: how each peer ran."""
        return {p.name: {"threads": p.threads, "gguf": self.models[p.bf16].name, "n_parallel": self.n_parallel,
                         "n_ctx": self.n_parallel * self.slot_ctx, "endpoint": ENDPOINT,
                         "prompt": "token ids (the target's tokenizer and chat template)",
                         "load_s": self.load_s[p.name]} for p in self.peers}
