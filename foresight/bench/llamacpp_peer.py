"""llama.cpp as a peer in `foresight bench --peers llamacpp`: what a user would run on a CPU instead.

llama.cpp runs in the bench process through the `xllamacpp` wheel: each peer is an `xllamacpp.Server` (the
llama.cpp server, in-process; it also listens on a random 127.0.0.1 port, unused here) with one slot, the
peer's thread count and no prompt caching, loaded once. A request goes in as the target's prompt token ids
(`handle_completions({"prompt": [ids...]})`, no BOS added, so llama.cpp sees the very tokens the modes see)
and its output comes back as token ids too: the `id` of every entry of the completion's logprobs
(`n_probs=1`, `post_sampling_probs`; the response carries no other token list), so nothing is
re-tokenized. The call releases the GIL while llama.cpp decodes.

Two peers per thread count:
* `llamacpp@Nt`: the target's GGUF source as shipped (the embedded default: Q4_1 blocks, token_embd Q8_0);
* `llamacpp-bf16@Nt`: the same weights rewritten once as a BF16 GGUF (every 2-D tensor dequantized and
  stored as BF16, the 1-D norms kept in F32 as llama.cpp's converter does): llama.cpp without its 4-bit
  kernels, beside Foresight serving dense weights.

Stopping: llama.cpp stops at its vocabulary's end-of-generation tokens (from the GGUF; the embedded
default's is <|im_end|> = 2, the target's eos too) and includes the one it stopped at, as transformers does;
the output is also cut after the first of the target's eos / the request's stop ids, should llama.cpp's
set lack one (its extra tokens then still count in wall_s).

Measured (2026-12-05, the 2-core dev machine, embedded default): `foresight bench --prompts chat --limit 2
--modes ar --max-tokens 32 --temperature 0 --peers hf,llamacpp --target-threads 1 --drafter-threads 1
--dtype float32 --quantization none` gives outputs_match_ar 1.0 for llamacpp-bf16 (and the hf peers), 0.5
for llamacpp (Q4_1); asking for the logprobs costs nothing measurable (12 paired 64-token greedy requests
at 1 thread: 435.8 vs 434.6 ms median, with and without).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..config import ConfigError, EngineConfig
from ..protocol.messages import GenerateRequest
from ..models.loading import cache_root, converted_name, gguf_source, resolve_target
from .peers import Peer, PeerGroup, PeerTally, peer_section

XLLAMACPP_INSTALL = "pip install xllamacpp==2026.10.11549"
# llama.cpp's samplers in the order Foresight and transformers apply them (spec/sampling.py);
# the default chain also has penalties, min_p (0.05), xtc, ... which Foresight does not.
SAMPLERS = ["temperature", "top_k", "top_p"]


def _xllamacpp():
    try:
        import xllamacpp
    except ImportError as e:
        raise ConfigError(f"peers: llamacpp needs the package xllamacpp; install it with: {XLLAMACPP_INSTALL}") from e
    return xllamacpp


def source_gguf(cfg: EngineConfig) -> Path:
    """The GGUF file the target was converted from; llama.cpp cannot run a dense folder."""
    path = gguf_source(resolve_target(cfg.target))
    if path is None:
        raise ConfigError(f"peers: llamacpp runs the target's GGUF file, and the target {cfg.target} has none "
                          "(give --target a .gguf file or use the embedded default)")
    return path


def bf16_path(source: Path) -> Path:
    """Where the BF16 rewrite of `source` lives: the cache folder, named as its conversions are."""
    return cache_root() / "models" / f"{converted_name(source)}.bf16.gguf"


def bf16_gguf(source: Path, log=print) -> Path:
    """`source` rewritten as a BF16 GGUF, once (tmp file + rename, so a crash leaves no half file)."""
    out = bf16_path(source)
    if out.is_file():
        return out
    log(f"[bench] writing {source.name} as BF16 -> {out} (once)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        _write_bf16(source, tmp)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_bf16(source: Path, out: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch)  # writes general.architecture itself
    _copy_metadata(reader, writer)
    for t in reader.tensors:
        # t.data: numpy-order array, [rows, bytes per row] (uint8) for block-quantized types.
        # dequantize -> float32 [rows, cols] (the GGUF shape reversed).
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if w.ndim == 1:
            writer.add_tensor(t.name, w)  # norms: F32, as convert_hf_to_gguf --outtype bf16 keeps them
        else:
            # quantize -> uint8 [rows, 2 * cols]; raw_dtype makes the writer read the shape back as [rows, cols]
            writer.add_tensor(t.name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_metadata(reader, writer) -> None:
    """Every key-value field (hyperparameters, tokenizer, chat template) but the file's own bookkeeping."""
    import gguf

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.MOSTLY_BF16)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)


def open_server(model: Path, threads: int):
    """A llama.cpp server on `model`: one slot, `threads` for decode and prefill, no prompt cache (each
    request pays its prefill, as the modes and the hf peers do), quiet."""
    return _xllamacpp().Server(server_params(model, threads))


def server_params(model: Path, threads: int):
    """open_server's settings, for a caller that changes some before starting (bench/llamacpp_load.py)."""
    p = _xllamacpp().CommonParams()
    p.model.path = str(model)
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_parallel = 1
    p.n_ctx = 0  # the model's own context length
    p.cache_prompt = False
    p.cache_idle_slots = False
    p.cache_ram_mib = 0
    p.verbosity = 0
    return p


def completion_body(request: GenerateRequest) -> dict:
    """The request as a llama.cpp completion: prompt token ids, max tokens, the request's sampling."""
    s = request.sampling
    body = {"prompt": list(request.prompt_ids), "n_predict": request.max_tokens, "cache_prompt": False,
            "n_probs": 1, "post_sampling_probs": True,  # the output's token ids come back in logprobs
            "ignore_eos": request.ignore_eos, "samplers": SAMPLERS, "temperature": s.temperature,
            "seed": s.seed if s.seed is not None else 0}
    if s.temperature > 0:  # temperature 0: llama.cpp keeps only the argmax (greedy)
        body.update(top_k=s.top_k or 0, top_p=s.top_p)  # top_k 0 = off in both
    return body


def output_ids(response: dict, stop: set[int]) -> list[int]:
    """Generated token ids of a completion response, cut after the first stop id."""
    choice = response["choices"][0]
    ids = [entry["id"] for entry in (choice.get("logprobs") or {}).get("content", [])]
    n = response["usage"]["completion_tokens"]
    if len(ids) != n:  # logprobs missing or cut short: the output cannot be compared token by token
        raise RuntimeError(f"llama.cpp returned {len(ids)} token ids for {n} generated tokens")
    cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
    return ids[:cut]


class LlamaCppPeers(PeerGroup):
    """llama.cpp for each planned peer, one request at a time (the HfPeers interface)."""

    def __init__(self, cfg: EngineConfig, peers: list[Peer]):
        self.peers = peers
        source = source_gguf(cfg)
        _xllamacpp()  # a missing wheel fails before the BF16 rewrite
        self.models = {False: source, True: bf16_gguf(source) if any(p.bf16 for p in peers) else None}
        self.eos = _eos_ids(cfg)
        self.servers, self.load_s = {}, {}
        for peer in peers:
            t0 = time.perf_counter()
            self.servers[peer.name] = open_server(self.models[peer.bf16], peer.threads)
            self.load_s[peer.name] = round(time.perf_counter() - t0, 3)
        self.tallies = {p.name: PeerTally(outputs=[]) for p in peers}

    def run(self, peer: Peer, request: GenerateRequest, tally: PeerTally | None = None) -> None:
        """`peer` on `request`, counted in `tally` (default: the peer's own); the time is the call alone."""
        body = completion_body(request)
        stop = set(request.stop_token_ids) | (set() if request.ignore_eos else set(self.eos))
        t0 = time.perf_counter()
        response = self.servers[peer.name].handle_completions(body)
        elapsed = time.perf_counter() - t0
        if "error" in response:
            raise RuntimeError(f"llama.cpp peer {peer.name}: {response['error']}")
        self.count(peer, tally, output_ids(response, stop), elapsed)

    def section(self, ar_outputs: list[list[int]] | None, modes: dict) -> dict:
        """As HfPeers.section, plus each peer's server load seconds and GGUF file."""
        out = peer_section(self.peers, self.tallies, ar_outputs, modes)
        for peer in self.peers:
            out[peer.name].update(load_s=self.load_s[peer.name], gguf=self.models[peer.bf16].name)
        return out


def _eos_ids(cfg: EngineConfig) -> list[int]:
    """The target's eos ids as the target worker reads them (generation_config, else config), without
    loading its weights."""
    from transformers import AutoConfig, GenerationConfig

    path = resolve_target(cfg.target)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoConfig.from_pretrained(path).eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
