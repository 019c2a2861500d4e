"""Configuration dataclasses shared by the CLI, the launcher and both workers.

Every flag of `foresight serve` / `foresight bench` lives here once; workers receive the
validated `EngineConfig` (as a plain dict over the spawn boundary) and nothing else.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from .protocol.kinds import Mode, Refinement

VERIFICATIONS = ("exact", "nucleus")
DTYPES = ("auto", "float32", "bfloat16", "float16")
VERIFY_LENGTHS = ("auto", "prefix", "max")
CPU_LINEARS = ("auto", "prepacked", "plain")  # models/cpu_linear.py
QUANTIZATIONS = ("auto", "none", "int4", "int8")  # models/quantization.py
COMPILES = ("auto", "on", "off")  # models/compiled_step.py
LOGPROBS_MODES = ("raw", "processed")  # target_worker/logprobs.py
TOOL_PARSERS = ("auto", "json", "hermes", "llama3_json")  # server/tool_formats.py
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the parameter."""


@dataclass(slots=True)
class EngineConfig:
    """What both workers need: models, devices, speculation settings."""

    target: str | None = None  # local HF folder; None = the embedded default
    drafter: str = "auto"  # "auto" | "ngram" | PATH to a trained drafter folder
    adapter: str = "auto"  # "auto" (<drafter>/adapter if present) | "none" | PATH: foresight for pipelined mode
    mode: Mode = Mode.AUTO  # a strategy for every round, or auto (protocol/kinds.py)
    verification: str = "exact"
    nucleus_threshold: float = 0.95
    block_size: int = 8  # anchor + gamma draft tokens verified per round
    cache_size: int = 4  # speculation cache entries (B) in pipelined mode
    # pipelined: outcome-score calibration (JetSpec++ B.1): "auto" (<adapter>/calibration.json if present) |
    # "none" (Eq. 6 scores) | PATH
    calibration: str = "auto"
    # pipelined: target layers the foresight decoder reuses; None = the adapter's recommendation, else
    # all layers above the deepest index the adapter predicts; 0 = none: the draft model scores the
    # outcomes itself (no adapter needed)
    decoder_layers: int | None = None
    # "auto": the prefix with the most expected tokens/s, or no drafts at all when that pays best;
    # "prefix": the same but at least one draft; "max": every draft
    verify_length: str = "auto"
    dtype: str = "auto"
    # The drafter's own dtype (draft model, adapter, decoder): "auto" = the target's on a GPU; on a CPU bf16
    # where the CPU has native bf16 matmuls, else fp32 (models/loading.py, resolve_drafter_dtype)
    drafter_dtype: str = "auto"
    # Linear layers on a CPU: "prepacked" = weights packed once for oneDNN (models/cpu_linear.py),
    # "plain" = nn.Linear, "auto" = prepacked for fp32 models (bf16 is not measured on a native-bf16 CPU yet)
    cpu_linear: str = "auto"
    # The target's linear weights: "int4" = 4-bit groups of 32 on torch's int4 kernel (a GGUF target's own
    # Q4 weights, else quantized at load), "int8" = 8-bit per output channel on torch's int8 kernel (quantized
    # at load), "none" = dense, "auto" = int4 for a GGUF target with 4-bit weights served in bf16 on a CPU
    # (models/quantization.py)
    quantization: str = "auto"
    # The target's forwards of a few tokens as ahead-of-time compiled graphs (AOTInductor, CPU):
    # "on", "off", "auto" = on for an int4 target on a CPU, where it measured faster (models/compiled_step.py)
    compile: str = "auto"
    # The draft model's block pass and context extension as such graphs: "on", "off", "auto" = on a CPU
    # (models/compiled_draft.py)
    drafter_compile: str = "auto"
    target_device: str = "cpu"
    drafter_device: str = "cpu"
    # The target split over this many devices by tensor parallelism (transformers' plan for its architecture):
    # on a GPU, target_device's index and the next ones; on a CPU, that many processes
    # (target_worker/tensor_parallel.py). Its forwards then run eager, on dense weights and plain linears.
    tensor_parallel_size: int = 1
    target_threads: int = 1
    drafter_threads: int = 1
    # CPU: a target step also runs on the drafter's threads while the drafter has nothing to do (no block
    # being drafted, no foresight running): plain and prompt-lookup rounds, and the verification of a
    # sync or hybrid block, during which the drafter waits for the outcome.
    borrow_drafter_threads: bool = True
    # CPU cores each worker process (and its threads) runs on, as a list like "0-3,8" ("" = not pinned); the api
    # takes the cores left. Pinned workers never borrow each other's threads (placement.py).
    target_cores: str = ""
    drafter_cores: str = ""
    ngram_max: int = 4  # longest n-gram the prompt-lookup proposer matches
    ngram_min: int = 2  # 1-gram matches mostly propose wrong drafts, which cost verify time
    hybrid_min_match: int = 3  # hybrid: prompt lookup drafts on a match of at least this many tokens
    draft_passes: int | None = None  # Jacobi passes after J0 (trained drafters); None = the checkpoint's default
    draft_refreshes: int | None = None  # pipelined: context refreshes per pre-drafted block at most; None = up to J
    # pipelined: Jacobi passes per pre-drafted block at most (the paper's J3); the verify-time budget picks how many
    # run (Eq. 3). Sync's draft_passes is its own: there every pass is exposed, here it hides behind verification.
    foresight_passes: int = 3
    refinement: Refinement = Refinement.ANCHOR  # pipelined: self-refinement of pre-drafted blocks
    foresight_budget: bool = True  # pipelined: fit B, J, R into the verify time; False: always the caps (ablations)
    max_model_len: int | None = None  # None = the target's own context length
    # Many requests at once: one target forward verifies every ready request's block ("batched steps";
    # targets with sliding-window or linear-attention layers step one request per forward), and a prompt
    # is prefilled in chunks of at most this many tokens per step, between the other requests' blocks.
    batched_steps: bool = True
    max_num_batched_tokens: int = 256
    model_name: str | None = None  # served name; None = folder name of the target
    # What logprobs report: "raw" = the target's own distribution, "processed" = the one each token was decided on
    # (logit rules, temperature, top-k, top-p), as vLLM's logprobs_mode (target_worker/logprobs.py)
    logprobs_mode: str = "raw"
    seed: int = 0
    # A JSON line per round after a pipelined one: what foresight pre-drafted and what came (drafter_worker/
    # round_log.py); "" = none
    round_log: str = ""

    def __post_init__(self) -> None:
        self.mode = Mode.parse(self.mode, "mode", ConfigError)
        _check_choice("verification", self.verification, VERIFICATIONS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("drafter_dtype", self.drafter_dtype, DTYPES)
        _check_choice("cpu_linear", self.cpu_linear, CPU_LINEARS)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("compile", self.compile, COMPILES)
        _check_choice("drafter_compile", self.drafter_compile, COMPILES)
        _check_choice("verify_length", self.verify_length, VERIFY_LENGTHS)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if not 0.0 < self.nucleus_threshold <= 1.0:
            raise ConfigError("nucleus_threshold must lie in (0, 1]")
        if not 2 <= self.block_size <= 64:
            raise ConfigError("block_size must lie in [2, 64] (anchor + at least one draft token)")
        if self.cache_size < 1:
            raise ConfigError("cache_size must be >= 1")
        if self.target_threads < 1 or self.drafter_threads < 1:
            raise ConfigError("thread counts must be >= 1")
        self._check_cores()
        self._check_tensor_parallel()
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")
        if not 1 <= self.hybrid_min_match <= self.ngram_max:
            raise ConfigError("hybrid_min_match must lie in [1, ngram_max]")
        if self.decoder_layers is not None and self.decoder_layers < 0:
            raise ConfigError("decoder_layers must be >= 0 (0: the draft model scores the outcomes itself)")
        if self.draft_passes is not None and self.draft_passes < 0:
            raise ConfigError("draft_passes must be >= 0")
        if self.draft_refreshes is not None and self.draft_refreshes < 0:
            raise ConfigError("draft_refreshes must be >= 0")
        if self.foresight_passes < 0:
            raise ConfigError("foresight_passes must be >= 0")
        self.refinement = Refinement.parse(self.refinement, "refinement", ConfigError)
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be >= block_size (one verify block per step)")

    def _check_cores(self) -> None:
        """Core lists parse, do not overlap, and hold at least as many cores as their worker's threads."""
        target, drafter = self.cores("target"), self.cores("drafter")
        if set(target) & set(drafter):
            raise ConfigError(f"target_cores and drafter_cores overlap (core(s) "
                              f"{format_cores(sorted(set(target) & set(drafter)))}): give each worker cores of its own")
        for owner, cores, threads in (("target", target, self.target_threads),
                                      ("drafter", drafter, self.drafter_threads)):
            if cores and threads > len(cores):
                raise ConfigError(f"{owner}_threads: {threads} threads on {len(cores)} core(s) "
                                  f"({owner}_cores {format_cores(cores)}); use at most one thread per core")

    def _check_tensor_parallel(self) -> None:
        """A split target runs eager on dense, plain linears; its devices exist and leave the drafter's alone."""
        size = self.tensor_parallel_size
        if size < 1:
            raise ConfigError("tensor_parallel_size must be >= 1")
        if size == 1:
            return
        for name, value, refused in (("compile", self.compile, ("on",)),
                                     ("quantization", self.quantization, ("int4", "int8")),
                                     ("cpu_linear", self.cpu_linear, ("prepacked",))):
            if value in refused:
                raise ConfigError(f"{name} {value!r} does not apply to a tensor-parallel target (its forwards run "
                                  f"eager on dense weights and plain linear layers): leave it at 'auto'")
        devices = self.target_devices()
        if self.drafter_device in devices and self.drafter_device != "cpu":
            raise ConfigError(f"drafter_device {self.drafter_device} is one of the tensor-parallel target's devices "
                              f"({', '.join(devices)}): give the drafter a device of its own")

    def target_devices(self) -> list[str]:
        """The devices the target's ranks run on: target_device and, on a GPU, the next indices after it."""
        device, _, index = self.target_device.partition(":")
        if device == "cpu" or self.tensor_parallel_size == 1:
            return [self.target_device] * self.tensor_parallel_size
        first = int(index or 0)
        return [f"{device}:{first + rank}" for rank in range(self.tensor_parallel_size)]

    def cores(self, owner: str) -> tuple[int, ...]:
        """The cores `owner` ("target" or "drafter") is pinned to (empty: not pinned)."""
        return parse_cores(getattr(self, f"{owner}_cores"), f"{owner}_cores")

    @property
    def pinned(self) -> bool:
        return bool(self.target_cores or self.drafter_cores)

    @property
    def gamma(self) -> int:
        """Draft tokens per block (the block holds the anchor plus gamma drafts)."""
        return self.block_size - 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        return cls(**data)


API_KEY_ENV = "FORESIGHT_API_KEY"
MIN_HEARTBEAT_TIMEOUT_S = 2.0  # four heartbeat intervals: one late beat must not look like a hang


@dataclass(slots=True)
class ServerConfig:
    """What only the api process needs."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 16  # requests the target interleaves at once (vLLM's name; --max-running is an alias)
    # Admission by memory: every running request reserves its worst-case KV footprint, len(prompt) +
    # max_tokens (at most max_model_len), until it ends; a request waits, first come first served, until
    # a sequence slot and its reservation both fit. None = no token budget (only max_num_seqs bounds it).
    max_kv_tokens: int | None = None
    max_waiting: int = 64  # requests waiting for admission; beyond this the api answers 429
    # A worker's start: the first start of a compiled target compiles its graphs (~8.5 min measured on 2 cores)
    startup_timeout_s: float = 1200.0
    max_restarts: int = 5  # per worker within restart_window_s; past that the api exits non-zero
    restart_window_s: float = 600.0
    # A worker whose heartbeats stop this long (stopped, frozen, dead) is hung: killed and restarted. Its
    # beats come from a thread every 0.5 s, so long steps do not count against this.
    heartbeat_timeout_s: float = 5.0
    # A worker whose loop has not turned this long is stuck in one step: hung too. Must exceed the longest
    # legitimate step (the prefill of the longest prompt: about a minute for 8k tokens on one CPU core).
    # 0 = never judged.
    stall_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests get to finish
    # A body is refused (413) past this size, read no further: one huge body must not stall the api.
    max_request_bytes: int = 4 << 20
    # Slow clients (headers or a body trickling in) hold a connection and a file descriptor each: their
    # headers must arrive within header_timeout_s of the connection (or of the previous response), their
    # body within body_timeout_s; past max_connections open ones, new requests get 503.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    request_timeout_s: float = 0.0  # wall-clock limit per request from its arrival; 0 = none
    idle_timeout_s: float = 0.0  # longest wait for a request's next output (first one included); 0 = none
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    # Control-token text inside chat message content becomes the control tokens (trusted clients only); by
    # default it is tokenized as text (server/chat_prompt.py)
    allow_special_tokens_in_content: bool = False
    # How tools are described and calls written: auto (by the chat template) | json | hermes | llama3_json
    # (server/tool_formats.py)
    tool_call_parser: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError("port must lie in 1..65535")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs (--max-num-seqs) must be >= 1 (got {self.max_num_seqs})")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting (--max-waiting) must be >= 0 (got {self.max_waiting})")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ConfigError(f"max_kv_tokens (--max-kv-tokens) must be >= 1 tokens, or unset for no budget "
                              f"(got {self.max_kv_tokens})")
        if self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes must be >= 1024")
        for name, value in (("header_timeout", self.header_timeout_s), ("body_timeout", self.body_timeout_s)):
            if not 0.0 < value < float("inf"):
                raise ConfigError(f"{name} (--{name.replace('_', '-')}) must be a finite number of seconds > 0 "
                                  f"(got {value})")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections (--max-connections) must be >= 1 (got {self.max_connections})")
        if not 0.0 <= self.request_timeout_s < float("inf"):
            raise ConfigError("request_timeout must be a finite number of seconds >= 0 (0 = no timeout)")
        if not 0.0 <= self.idle_timeout_s < float("inf"):
            raise ConfigError("idle_timeout must be a finite number of seconds >= 0 (0 = no timeout)")
        if self.api_key is not None and (not self.api_key.strip() or not self.api_key.isprintable()):
            raise ConfigError("api_key must be non-empty printable text")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts must be >= 0")
        if not 0.0 < self.restart_window_s < float("inf"):
            raise ConfigError("restart_window must be a finite number of seconds > 0")
        if not MIN_HEARTBEAT_TIMEOUT_S <= self.heartbeat_timeout_s < float("inf"):
            raise ConfigError(f"heartbeat_timeout must be a finite number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S:g} "
                              f"(workers beat every 0.5 s)")
        if not (self.stall_timeout_s == 0 or self.heartbeat_timeout_s <= self.stall_timeout_s < float("inf")):
            raise ConfigError("stall_timeout must be 0 (off) or a finite number of seconds >= heartbeat_timeout")
        if not 0.0 <= self.drain_timeout_s < float("inf"):
            raise ConfigError("drain_timeout must be a finite number of seconds >= 0")
        if not 0.0 < self.startup_timeout_s < float("inf"):
            raise ConfigError("startup_timeout must be a finite number of seconds > 0")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"tool_call_parser (--tool-call-parser) must be one of {', '.join(TOOL_PARSERS)} "
                              f"(got {self.tool_call_parser!r})")


def parse_cores(text: str, name: str) -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8): a Linux CPU list (as taskset and cpuset take them); "" -> ()."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (high and int(high) < int(low)):
            raise ConfigError(f"{name}: {part!r} is not a core or a range of cores (expected a list like 0-3,8)")
        cores.update(range(int(low), int(high or low) + 1))
    if text.strip() and not cores:
        raise ConfigError(f"{name}: no core in {text!r}")
    return tuple(sorted(cores))


def format_cores(cores) -> str:
    return ",".join(map(str, cores))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and speculation flags shared by `serve` and `bench`."""
    d = EngineConfig()
    g = parser.add_argument_group("model and speculation")
    g.add_argument("--target", default=d.target, help="local Hugging Face causal-LM folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--drafter", default=d.drafter, help="auto | ngram | PATH to a trained drafter")
    g.add_argument("--adapter", default=d.adapter, help="auto | none | PATH to a trained adapter (foresight)")
    g.add_argument("--mode", default=d.mode, choices=Mode.values(),
                   help="auto (default): every round, the strategy with the best measured goodput among those "
                        "the drafter offers; ar | sync | pipelined | ngram (prompt lookup) | hybrid (prompt lookup "
                        "on a long match, else the draft model): that strategy for every round")
    g.add_argument("--verification", default=d.verification, choices=VERIFICATIONS)
    g.add_argument("--nucleus-threshold", type=float, default=d.nucleus_threshold)
    g.add_argument("--block-size", type=int, default=d.block_size, help="anchor + draft tokens per verification")
    g.add_argument("--cache-size", type=int, default=d.cache_size, help="speculation cache entries (pipelined)")
    g.add_argument("--calibration", default=d.calibration,
                   help="pipelined: auto (<adapter>/calibration.json if present) | none (uncalibrated outcome "
                        "scores) | PATH to a fitted calibration (foresight calibrate-foresight)")
    g.add_argument("--decoder-layers", type=int, default=d.decoder_layers,
                   help="pipelined: target layers the foresight decoder reuses (default: the adapter's "
                        "recommendation, else all layers above the deepest one it predicts); 0: no decoder nor "
                        "adapter, the draft model scores the outcomes itself")
    g.add_argument("--verify-length", default=d.verify_length, choices=VERIFY_LENGTHS,
                   help="auto: verify the prefix of each block with the most expected tokens per second, "
                        "or skip drafting while plain steps pay best; prefix: the same, at least one draft; "
                        "max: all drafts")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    g.add_argument("--drafter-dtype", default=d.drafter_dtype, choices=DTYPES,
                   help="the drafter's dtype (auto: the target's on a GPU; on a CPU bf16 where it has native "
                        "bf16 matmuls, else float32)")
    g.add_argument("--cpu-linear", default=d.cpu_linear, choices=CPU_LINEARS,
                   help="linear layers on a CPU: prepacked (weights packed once for oneDNN), plain (nn.Linear), "
                        "auto (prepacked for float32 models)")
    g.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="the target's linear weights: int4 (4-bit groups of 32 on torch's int4 CPU kernel: a GGUF "
                        "target's own Q4 weights, else quantized at load), int8 (8-bit per output channel on "
                        "torch's int8 CPU kernel, quantized at load), none (dense), auto (int4 for a GGUF "
                        "target with 4-bit weights served in bf16 on a CPU, e.g. the embedded default)")
    g.add_argument("--compile", default=d.compile, choices=COMPILES,
                   help="the target's steps (1 to block-size tokens of one or several requests) as ahead-of-time "
                        "compiled graphs (AOTInductor, CPU, full-attention targets; compiled at the first start, then "
                        "loaded from the cache folder): on, off, auto (on for an int4 target on a CPU)")
    g.add_argument("--drafter-compile", default=d.drafter_compile, choices=COMPILES,
                   help="the draft model's block pass and context extension as ahead-of-time compiled graphs "
                        "(AOTInductor, CPU; any batch, block and context; compiled at the first start in about 30 s, "
                        "then loaded from the cache folder): on, off, auto (on a CPU)")
    g.add_argument("--target-device", default=d.target_device)
    g.add_argument("--drafter-device", default=d.drafter_device)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split the target over this many devices (transformers' tensor-parallel plan for its "
                        "architecture): on a GPU --target-device and the next ones, on a CPU that many processes; "
                        "its forwards then run eager on dense weights")
    g.add_argument("--target-threads", type=int, default=d.target_threads)
    g.add_argument("--drafter-threads", type=int, default=d.drafter_threads)
    g.add_argument("--borrow-drafter-threads", default=d.borrow_drafter_threads,
                   action=argparse.BooleanOptionalAction,
                   help="CPU: target steps also use the drafter's threads while the drafter idles")
    g.add_argument("--target-cores", default=d.target_cores,
                   help="CPU cores the target worker runs on, e.g. 0-3 (default: not pinned); pinned workers never "
                        "borrow each other's threads, and the api runs on the cores left")
    g.add_argument("--drafter-cores", default=d.drafter_cores,
                   help="CPU cores the drafter worker runs on, e.g. 4-5 (default: not pinned)")
    g.add_argument("--ngram-max", type=int, default=d.ngram_max, help="prompt lookup: longest n-gram matched")
    g.add_argument("--ngram-min", type=int, default=d.ngram_min, help="prompt lookup: shortest n-gram matched")
    g.add_argument("--hybrid-min-match", type=int, default=d.hybrid_min_match,
                   help="hybrid: prompt lookup drafts on a match of at least this many tokens, else the draft model")
    g.add_argument("--draft-passes", type=int, default=d.draft_passes, help="trained drafter: Jacobi passes after J0")
    g.add_argument("--draft-refreshes", type=int, default=d.draft_refreshes,
                   help="pipelined: context refreshes per pre-drafted block at most (default: one before each pass)")
    g.add_argument("--foresight-passes", type=int, default=d.foresight_passes,
                   help="pipelined: Jacobi passes per pre-drafted block at most; the verify time decides how many "
                        "run (0: the initial draft only)")
    g.add_argument("--refinement", default=d.refinement, choices=Refinement.values(),
                   help="pipelined: self-refinement of pre-drafted blocks (none: Jacobi passes only; "
                        "refresh: + context refresh; anchor: + anchor replacement)")
    g.add_argument("--foresight-budget", default=d.foresight_budget, action=argparse.BooleanOptionalAction,
                   help="pipelined: fit outcomes, passes and refreshes into the measured verify time "
                        "(--no-foresight-budget: always --cache-size, --draft-passes, --draft-refreshes)")
    g.add_argument("--round-log", default=d.round_log, metavar="FILE",
                   help="pipelined: append a JSON line per round to FILE with the outcomes foresight pre-drafted, "
                        "the one that came, and how its job went (to take the hit rate apart)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--batched-steps", default=d.batched_steps, action=argparse.BooleanOptionalAction,
                   help="one target forward verifies every ready request's block (--no-batched-steps: one "
                        "request per forward, round-robin)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens one target step processes at most: prompts are prefilled in chunks of this size "
                        "between other requests' verify blocks")
    g.add_argument("--served-model-name", dest="model_name", default=d.model_name)
    g.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=LOGPROBS_MODES,
                   help="what logprobs report: raw (the target's own next-token distribution, as OpenAI) or "
                        "processed (the distribution each token was decided on: logit bias and penalties, then "
                        "temperature, top-k and top-p)")
    g.add_argument("--seed", type=int, default=d.seed)


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    cfg = EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
    check_cores_exist(cfg)
    return cfg


def check_cores_exist(cfg: EngineConfig) -> None:
    """The pinned cores are ones this process may run on (checked once, where the flags are read: a worker
    inherits the api's narrower set)."""
    available = os.sched_getaffinity(0)
    for owner in ("target", "drafter"):
        missing = sorted(set(cfg.cores(owner)) - available)
        if missing:
            raise ConfigError(f"{owner}_cores: core(s) {format_cores(missing)} do not exist or are not available "
                              f"to this process (available: {format_cores(sorted(available))})")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The api's own flags (`serve` only)."""
    d = ServerConfig()
    g = parser.add_argument_group("api")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--max-num-seqs", "--max-running", dest="max_num_seqs", type=int, default=d.max_num_seqs,
                   help=f"requests running in the target at once; others wait (default {d.max_num_seqs}; "
                        "--max-running is the old name)")
    g.add_argument("--max-kv-tokens", type=int, default=d.max_kv_tokens,
                   help="KV-cache token budget: each running request reserves len(prompt) + max_tokens until it "
                        "ends, and a request waits (first come first served) until its reservation fits; one "
                        "larger than the whole budget gets 400 (default: no budget)")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"requests waiting for admission; beyond this the api answers 429 (default {d.max_waiting})")
    g.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s)
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection may take to send a request's headers (from its opening, or from "
                        f"the previous response); then it is answered 408 and closed (default {d.header_timeout_s:g})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help=f"seconds a request's body may take to arrive; then 408 (default {d.body_timeout_s:g})")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections (and requests) beyond which new requests get 503 at once "
                        f"(default {d.max_connections})")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds a request may take from arrival, queueing included; then it is aborted "
                        "(504, or an error event in a stream). 0 = no limit")
    g.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s,
                   help="seconds a request may wait for its next output (its first included, queueing too); "
                        "then it is aborted like a request past --request-timeout. 0 = no limit")
    g.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="restarts per worker within --restart-window; past that the server exits with status 1 "
                        "(for compose / Kubernetes to restart it)")
    g.add_argument("--restart-window", type=float, default=d.restart_window_s, help="seconds (default 600)")
    g.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                   help="seconds without a heartbeat after which a worker counts as hung (stopped, frozen) and "
                        "is restarted; a hung drafter: requests go on without drafts meanwhile (default 5)")
    g.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds a worker's loop may spend in one step (e.g. the prefill of a long prompt) "
                        "before it counts as stuck and is restarted; 0 = never (default 300)")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are "
                        "stopped with an error; then the server exits 0 (default 30)")
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer <key>` on /v1/* (default: ${API_KEY_ENV}; "
                        "/health and /metrics stay open)")
    g.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="chat: text of control tokens (<|im_end|>, ...) inside a message becomes those tokens, for "
                        "clients you trust; by default it is tokenized as text, so no message can forge a turn")
    g.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=TOOL_PARSERS,
                   help="how tools are described and calls written: hermes (<tool_call> tags: Qwen, Hermes), "
                        "llama3_json (Llama 3.1+), json (this server's own, tools in a system message), or auto: "
                        "by the chat template (default auto)")


def server_from_args(args: argparse.Namespace, engine: EngineConfig) -> ServerConfig:
    # The key may come from the environment so that it stays out of `ps` and shell history.
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    return ServerConfig(host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                        max_kv_tokens=args.max_kv_tokens,
                        max_waiting=args.max_waiting, startup_timeout_s=args.startup_timeout,
                        max_request_bytes=args.max_request_bytes, request_timeout_s=args.request_timeout,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        max_connections=args.max_connections,
                        idle_timeout_s=args.idle_timeout,
                        api_key=api_key, max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                        heartbeat_timeout_s=args.heartbeat_timeout, stall_timeout_s=args.stall_timeout,
                        drain_timeout_s=args.drain_timeout,
                        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                        tool_call_parser=args.tool_call_parser, engine=engine)
