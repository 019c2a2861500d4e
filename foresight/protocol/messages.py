"""Typed messages between the api, the target worker and the drafter worker.

One dataclass per message kind. The codec writes the kind first, then the protocol version, then
the fields; tensors travel beside the msgpack body (see `transport`). Every message about a request
carries its `req_id`; round-scoped messages also carry `round` so stale ones can be dropped.
Modes, strategies and refinements travel as their strings and are parsed into their enums (`kinds.py`)
in `__post_init__`, which decoding runs too: a bad value fails the message's construction with a
ValueError naming the field (a decoded one: a ProtocolError).

Round numbering: the target's prefill is round 0. `Outcome(round=r)` reports how verification of
round r-1's block ended (or the prefill, for r=1) and asks for the block of round r;
`DraftBlock(round=r)` answers it. A block whose round differs from the one the target waits for is
stale and is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from .kinds import Mode, Refinement, Strategy

PROTOCOL_VERSION = 10  # raised whenever a message kind or field changes: peers of another version refuse

MESSAGE_TYPES: dict[str, type] = {}


def message(cls=None, /, *, frozen: bool = False):
    """Register a message dataclass under its KIND (`frozen`: an immutable value, as `@message(frozen=True)`)."""

    def register(cls):
        cls = dataclass(slots=True, frozen=frozen)(cls)
        kind = cls.KIND
        if kind in MESSAGE_TYPES:
            raise ValueError(f"duplicate message kind {kind}")
        MESSAGE_TYPES[kind] = cls
        return cls

    return register if cls is None else register(cls)


# ---------------------------------------------------------------- api -> target


@message
class SamplingParams:
    KIND: ClassVar[str] = "sampling_params"
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    verification: str = "exact"  # "exact" | "nucleus"
    nucleus_threshold: float = 0.95
    # Logit rules on the target's distribution (target_worker/logit_rules.py); the defaults change nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias) pairs
    min_tokens: int = 0  # stop tokens are held back until this many tokens were generated
    # Log-probabilities (target_worker/logprobs.py): None = none; k >= 0 = each token's and the k most likely
    # alternatives', of the generated tokens (`logprobs`) and of the prompt's (`prompt_logprobs`)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: an llguidance grammar (server/structured.py) every committed token must follow
    grammar: str | None = None


@message
class GenerateRequest:
    KIND: ClassVar[str] = "generate"
    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    mode: Mode | None = None  # None = the server's mode (bench sets it)
    refinement: Refinement | None = None  # pipelined; None = the server's (bench sets it)

    def __post_init__(self) -> None:
        self.mode = Mode.parse_optional(self.mode, "mode")
        self.refinement = Refinement.parse_optional(self.refinement, "refinement")


@message
class AbortRequest:
    KIND: ClassVar[str] = "abort"
    req_id: str


@message
class Shutdown:
    KIND: ClassVar[str] = "shutdown"
    reason: str = ""


@message
class DrafterStatus:
    """The supervisor's word on the drafter. Down: stop waiting for blocks and send it nothing; running
    requests go on without drafts (plain one-token steps, the target's own verdicts, so output is
    unchanged) until they end. Up: a fresh drafter is ready; requests started from now on use it."""

    KIND: ClassVar[str] = "drafter_status"
    up: bool
    reason: str = ""


# ---------------------------------------------------------------- target -> api


@message
class RoundStats:
    """One verification round of one request, for the api's metrics."""

    KIND: ClassVar[str] = "round_stats"
    drafted: int  # draft tokens verified this round (0 for ar / no proposal)
    accepted: int  # of those, accepted
    nucleus_extra: int  # acceptances only the nucleus gate allowed
    verify_s: float
    exposed_draft_s: float | None  # target waited this long for the block; None in ar
    cache_hit: bool | None  # None when no speculation cache was consulted
    passes: int = 0  # drafter refinement passes used for the block
    refreshes: int = 0  # drafter context refreshes used for the block
    strategy: Strategy = Strategy.AR  # how the round ran; in mode auto, what the chooser picked
    compiled: bool | None = None  # whether a compiled graph verified it (None: the target has no compiled steps)

    def __post_init__(self) -> None:
        self.strategy = Strategy.parse(self.strategy, "strategy")


@message
class TokenLogprobs:
    """Log-probabilities of n tokens (target_worker/logprobs.py): each one's, and its position's k most likely
    tokens with theirs (-inf where a token is impossible: masked by a rule, top-k or top-p)."""

    KIND: ClassVar[str] = "token_logprobs"
    values: list[float]  # [n]
    top_ids: list[list[int]]  # [n][k], most likely first
    top_values: list[list[float]]  # [n][k]

    def __len__(self) -> int:
        return len(self.values)

    def head(self, n: int) -> "TokenLogprobs":
        """The first n tokens'."""
        return TokenLogprobs(self.values[:n], self.top_ids[:n], self.top_values[:n])

    @classmethod
    def join(cls, parts: Sequence["TokenLogprobs"]) -> "TokenLogprobs":
        return cls([v for p in parts for v in p.values], [t for p in parts for t in p.top_ids],
                   [t for p in parts for t in p.top_values])


@message
class TokenOutput:
    KIND: ClassVar[str] = "tokens"
    req_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    rounds: list[RoundStats] = field(default_factory=list)
    prompt_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked for them
    # Of the prompt's tokens after its first (which has none), with the request's first output
    prompt_logprobs: TokenLogprobs | None = None


@message
class RequestFailed:
    """One request failed (bad input reached the worker, OOM, ...); the worker goes on."""

    KIND: ClassVar[str] = "request_failed"
    req_id: str
    error: str
    status: int = 500


def _layer_indices(name: str, layers: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(i) for i in layers)
    if any(i < 0 for i in out) or list(out) != sorted(set(out)):
        raise ValueError(f"{name} must be distinct ascending indices >= 0 (got {list(out)})")
    return out


@message(frozen=True)
class HiddenLayout:
    """The target states a drafter reads, laid out as the target sends them (`StartDraft.hidden`,
    `Outcome.hidden`): per position, the states at hidden_states indices `layers` (index i is the output of
    decoder layer i-1, 0 the embeddings), concatenated in that ascending order -> [positions, width],
    width = len(layers) * hidden_size. Every consumer takes its own `columns` of it. `state_layers`: the
    linear-attention layers of a hybrid target whose committed state travels as `LinearStates`."""

    KIND: ClassVar[str] = "hidden_layout"
    layers: tuple[int, ...] = ()
    hidden_size: int = 0  # the target's; 0 only without layers
    state_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Decoded from msgpack the indices come as lists: made tuples so the layout stays immutable.
        object.__setattr__(self, "layers", _layer_indices("layers", self.layers))
        object.__setattr__(self, "state_layers", _layer_indices("state_layers", self.state_layers))
        if self.hidden_size < 0 or (self.layers and self.hidden_size == 0):
            raise ValueError(f"hidden_size must be > 0 when there are layers (got {self.hidden_size})")

    @property
    def width(self) -> int:
        """Columns per position."""
        return len(self.layers) * self.hidden_size

    def columns(self, indices: Sequence[int]) -> torch.Tensor:
        """[len(indices) * hidden_size] long: the columns of the states at `indices`, in that order."""
        missing = [i for i in indices if i not in self.layers]
        if missing:
            raise ValueError(f"hidden_states indices {missing} are not in the layout's {list(self.layers)}")
        offsets = torch.tensor([self.layers.index(i) * self.hidden_size for i in indices], dtype=torch.long)
        return (offsets[:, None] + torch.arange(self.hidden_size)).flatten()  # [n, hidden] -> [n * hidden]

    def select(self, hidden: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        """The states at `indices` from hidden [..., width] -> [..., len(indices) * hidden_size]."""
        return hidden[..., self.columns(indices)]

    def concat(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The layout of a forward's `hidden_states` (one [..., hidden_size] tensor per index) -> [..., width]."""
        return torch.cat([hidden_states[i] for i in self.layers], dim=-1)


@message
class WorkerReady:
    KIND: ClassVar[str] = "ready"
    worker: str  # "target" | "drafter"
    pid: int
    info: dict[str, Any] = field(default_factory=dict)
    layout: HiddenLayout | None = None  # the drafter's: the target states it reads (the target starts with it)


@message
class WorkerDead:
    """Sent by a worker whose loop is about to die, so its peers need not wait for the sentinel."""

    KIND: ClassVar[str] = "dead"
    worker: str
    error: str
    pid: int = 0  # which incarnation died (a late message of an earlier one is ignored)


@message
class Heartbeat:
    """Sent by a worker every HEARTBEAT_INTERVAL_S from a thread of its own (liveness.Heartbeats): silence
    means a stopped, frozen or dead process; a growing `stalled_s` a loop stuck in one step."""

    KIND: ClassVar[str] = "heartbeat"
    worker: str
    pid: int
    stalled_s: float = 0.0  # seconds since the worker's loop last turned


@message
class ControllerStats:
    """Sent by the target every CONTROLLER_STATS_S while it serves: its round planner's current figures
    (`control/round_planner.py`), for Prometheus. Goodputs are committed tokens per second."""

    KIND: ClassVar[str] = "controller"
    auto_goodput: dict[str, float] = field(default_factory=dict)  # "class/strategy" -> mode auto's pooled estimate
    auto_exploring: dict[str, float] = field(default_factory=dict)  # class -> share of its time trials cost
    policy: str = ""  # the load policy running now ("": the worker does not batch requests)
    load_level: int = 0  # the load level it counts for (0: a lone request, no policy)
    policy_goodput: dict[str, float] = field(default_factory=dict)  # "level/policy" -> the policy's estimate


# ---------------------------------------------------------------- target <-> drafter


@message
class LinearStates:
    """A hybrid target's committed Gated DeltaNet state at the linear-attention layers the drafter asked for
    (its foresight decoder's): what those layers hold after positions 0..position-1, the committed tokens
    before the anchor. Sent with the StartDraft and Outcome that commit those positions; one whose
    `position` is not the drafter's context length is stale and is never used."""

    KIND: ClassVar[str] = "linear_states"
    position: int
    layers: list[int]  # target layer indices, ascending
    conv: torch.Tensor  # [n_layers, conv_dim, kernel] in the target's dtype
    recurrent: torch.Tensor  # [n_layers, value_heads, key_dim, value_dim] float32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


@message
class StartDraft:
    """A new request: its prompt and the target states of the prompt positions."""

    KIND: ClassVar[str] = "start_draft"
    req_id: str
    prompt_ids: list[int]
    seed: int  # for the drafter's own noise; derived so it never mirrors the target's draws
    temperature: float = 1.0  # the request's sampling temperature (foresight ranks outcomes for it)
    refinement: Refinement | None = None  # the request's self-refinement (GenerateRequest); None = the drafter's
    hidden: torch.Tensor | None = None  # [prompt_len, n_layers * hidden] or None
    # The request's sampling and verification rule: foresight scores outcomes under them (top-k, top-p,
    # exact or nucleus). None: temperature alone, exact verification.
    sampling: SamplingParams | None = None
    linear_states: LinearStates | None = None  # hybrid targets: the state after the prompt (see LinearStates)

    def __post_init__(self) -> None:
        self.refinement = Refinement.parse_optional(self.refinement, "refinement")


@message
class Outcome:
    """Verification of the previous block ended with `accepted` drafts and token `bonus`.

    For round 1 (right after StartDraft) accepted = 0 and bonus = the first token.
    """

    KIND: ClassVar[str] = "outcome"
    req_id: str
    round: int
    accepted: int
    bonus: int
    max_drafts: int  # at most this many draft tokens are wanted (limits near max_tokens)
    verify_s: float = 0.0  # the target's last verify time: the drafter's foresight budget (paper Eq. 3)
    # This request's part of verify_s when its block shared a batched forward (the verify-length controller's
    # price of the block); None: the block had the forward to itself.
    verify_share_s: float | None = None
    hidden: torch.Tensor | None = None  # [accepted + 1, n_layers * hidden] states of committed positions
    # How round `round` runs. The target sends an Outcome only for a round that wants a block; "ar" / "ngram"
    # rounds (a plain step, prompt lookup by the target) are reported with the next.
    strategy: Strategy = Strategy.SYNC
    # Set when the drafter did not draft what is reported (rounds of "ar" / "ngram", reported together in the
    # Outcome of the next round that wants a block): the committed tokens before `bonus` (`accepted` of
    # them), and `hidden` holds their states. None: `accepted` counts drafts of the drafter's own last block.
    drafts: list[int] | None = None
    linear_states: LinearStates | None = None  # hybrid targets: the state after the committed positions
    # With a round the target runs alone: take every committed state into every model now (a foresight
    # drafter's adapter and decoder too), then answer DrafterIdle. Mode auto asks it before switching to
    # "pipelined", and runs prompt lookup meanwhile, so that no pipelined round waits for the catch-up.
    catch_up: bool = False

    def __post_init__(self) -> None:
        self.strategy = Strategy.parse(self.strategy, "strategy")


@message
class ReleaseDraft:
    KIND: ClassVar[str] = "release_draft"
    req_id: str


@message
class DraftBlock:
    KIND: ClassVar[str] = "draft_block"
    req_id: str
    round: int
    tokens: list[int]  # the gamma draft tokens (may be fewer, or empty: no proposal)
    cache_hit: bool | None = None  # pipelined rounds: whether foresight had pre-drafted it
    passes: int = 0  # refinement passes spent on it
    refreshes: int = 0  # context refreshes spent on it


@message
class DrafterIdle:
    """The drafter's answer to an `Outcome` that opens a round the target runs alone ("ar", "ngram"): it has
    stopped the request's foresight work (and with `Outcome.catch_up`, finished the catch-up), so the
    target's steps may run on the drafter's cores too."""

    KIND: ClassVar[str] = "drafter_idle"
    req_id: str
    round: int  # the Outcome's round


# ---------------------------------------------------------------- a tensor-parallel target: rank 0 -> the other ranks
# Each names one call of the target's runner that runs or changes a cache; the other ranks repeat it on their shards
# (target_worker/tensor_parallel.py). Caches are named by the number rank 0 gave them.


@message
class ShardCacheNew:
    KIND: ClassVar[str] = "shard_cache_new"
    cache: int


@message
class ShardCacheCopy:
    """`cache` starts as a copy of `source` (a request that takes another's prefill of the same prompt)."""

    KIND: ClassVar[str] = "shard_cache_copy"
    source: int
    cache: int


@message
class ShardCacheFree:
    KIND: ClassVar[str] = "shard_cache_free"
    caches: list[int]


@message
class ShardForward:
    KIND: ClassVar[str] = "shard_forward"
    cache: int
    tokens: list[int]
    keep_logits: int | None = None
    rollback: bool = False
    argmax_only: bool = False


@message
class ShardVerifyBatch:
    KIND: ClassVar[str] = "shard_verify_batch"
    caches: list[int]
    blocks: list[list[int]]
    chunk_cache: int | None = None  # a prompt chunk sharing the forward: its cache and its tokens
    chunk_tokens: list[int] = field(default_factory=list)


@message
class ShardRollback:
    KIND: ClassVar[str] = "shard_rollback"
    cache: int
    rejected: int
