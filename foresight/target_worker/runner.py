"""The target model's forwards: prefill, block verification and cache rollback, one request at a time.

A request's KV cache always holds exactly its committed tokens except the newest one (the anchor
of the next block): each verify forward feeds `[anchor, d_1..d_gamma]`, and after the verdict the
rejected tail is cropped so the cache again ends just before the new anchor.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..models.compiled_step import CompiledStep, causal_mask
from ..protocol.messages import HiddenLayout, LinearStates
from .argmax_head import argmax_head_for
from .batched_kv import BatchedKV, batchable
from .linear_rollback import LinearSnapshot, LinearStateRollback
from .logit_head import LOGIT_PRECISIONS, Fp32LogitHead, needs_fp32_head, soft_cap
from .packed_step import PACKS_OVER, PackedStep, packed_attention
from ..models.slot_kv import no_keys, slot_cache

log = logging.getLogger("foresight.runner")


@dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [positions, vocab] float32, one row per fed position
    hidden: torch.Tensor | None  # [positions, layout.width] states at the layout's layers
    linear_snapshot: LinearSnapshot | None = None  # hybrid targets: what rollback() needs
    # [positions, hidden] fp32 final-norm output behind the logits of a low-precision target whose logits were
    # refined near each row's maximum ("fp32-top"): logit rules that move the maximum refine again from it
    head_input: torch.Tensor | None = None
    compiled: bool = False  # computed by a compiled graph (models/compiled_step.py), not the eager forward


class TargetRunner:
    """Wraps a Hugging Face causal LM for per-request prefill / verify with a DynamicCache."""

    def __init__(self, model, layout: HiddenLayout | None = None, logits: str = "fp32-top",
                 compiled: CompiledStep | None = None):
        """`layout`: the target states each forward returns (`ForwardResult.hidden`), and the linear-attention
        layers whose committed state `linear_states` copies (None: neither). `compiled`: graphs for forwards
        of a few tokens of one request (models/compiled_step.py; built for this layout's layers)."""
        self.model = model
        self.compiled = compiled
        self.eager_forwards = 0  # with `compiled`: single-request forwards of more tokens than its buckets
        self.eager_batches = 0  # with `compiled`: batched forwards run eager (too wide, padded, or with a chunk)
        self.config = model.config
        self.device = next(model.parameters()).device
        self.layout = layout or HiddenLayout()
        self._check_layout()
        self.linear = LinearStateRollback(model)  # empty unless the target has linear-attention layers
        self.linear.check_layers(list(self.layout.state_layers))
        # A bf16/fp16 target still decides in fp32: its final norm and LM head run in fp32 (logit_head.py).
        if logits not in LOGIT_PRECISIONS:
            raise ValueError(f"logits must be one of {LOGIT_PRECISIONS}, got {logits!r}")
        self.logit_precision = logits if needs_fp32_head(model) else "model"
        self.head = Fp32LogitHead(model) if self.logit_precision != "model" else None
        # A compiled step of one greedy request decides by the argmax alone: an int8 head serves it (argmax_head.py).
        self.argmax_head = argmax_head_for(self.head, self.device) \
            if compiled is not None and self.logit_precision == "fp32-top" else None
        self.argmax_rows = 0  # rows whose logits the int8 head computed
        self.last_batch: BatchedKV | None = None  # the last batched forward's KV layout, reused while it fits

    def compile_info(self) -> dict:
        """What runs compiled (for the bench's report): the token buckets, the batched graphs, the prompt-chunk
        graph's most tokens, seconds spent compiling at start-up and packages loaded from the cache, and the most
        threads a graph's work is split for."""
        if self.compiled is None:
            return {"buckets": [], "batch_ranges": [], "block_tokens": 0, "chunk_tokens": [], "compile_s": 0.0,
                    "loaded": 0, "threads": 0}
        graphs, chunk = self.compiled.graphs, self.compiled.chunk_shape
        return {"buckets": list(self.compiled.buckets),
                "batch_ranges": [list(shape.rows) for shape in graphs if shape.batched],
                "block_tokens": self.compiled.block_tokens if any(s.blocks and s.batched for s in graphs) else 0,
                "chunk_tokens": [chunk.tokens, chunk.tokens_to] if chunk in graphs else [],
                "compile_s": round(self.compiled.compile_s, 1), "loaded": self.compiled.loaded,
                "threads": self.compiled.threads}

    @classmethod
    def for_proposer(cls, model, proposer, **kw) -> "TargetRunner":
        """A runner that sends what `proposer` reads (its `layout`)."""
        return cls(model, proposer.layout, **kw)

    def _check_layout(self) -> None:
        """The drafter must have been built for this target: its layout's width is the target's."""
        hidden_size = getattr(self.config, "hidden_size", None)
        if self.layout.layers and hidden_size is not None and self.layout.hidden_size != hidden_size:
            raise ValueError(f"the drafter reads target states of width {self.layout.hidden_size}; this "
                             f"target's are {hidden_size} wide")

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.config)
        if self.compiled is not None:
            slot_cache(cache)  # compiled forwards write into buffers in place
        if self.has_sliding_layers:
            # Sliding-window layers drop old positions as they go; recording keeps what a crop of
            # rejected drafts needs to restore (rollback() trims it back to the window each round).
            cache.activate_past_recording()
        return cache

    def copy_cache(self, cache: DynamicCache) -> DynamicCache:
        """A cache that starts as `cache` holds now (a request taking another's prefill of the same prompt)."""
        return copy.deepcopy(cache)  # views keep pointing into the copied buffers (one memo)

    @property
    def has_sliding_layers(self) -> bool:
        return any(t == "sliding_attention" for t in getattr(self.config, "layer_types", None) or [])

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, tokens: list[int], keep_logits: int | None = None,
                rollback: bool = False, argmax_only: bool = False) -> ForwardResult:
        """Feed `tokens` after what `cache` holds; return logits for the last `keep_logits` positions.

        `rollback`: the caller may crop some of these positions again (hybrid targets then snapshot
        their linear-attention states first). `argmax_only`: only the argmax of each row of logits will be read
        (the other entries may then be off by a bound: argmax_head.py)."""
        snap, hooks = self.linear.begin(cache) if (rollback and self.linear) else (None, [])
        try:
            return self._forward(cache, tokens, keep_logits, snap, argmax_only)
        finally:
            for handle in hooks:
                handle.remove()

    def _forward(self, cache, tokens, keep_logits, snap, argmax_only: bool = False) -> ForwardResult:
        if self.compiled is not None and snap is None:  # new_cache: SlotLayers
            graph = self.compiled.single_graph(len(tokens))
            if graph is not None:
                return self._forward_compiled(cache, tokens, keep_logits, *graph, argmax_only)
            self.eager_forwards += 1
            if self.eager_forwards == 1:
                log.warning("a forward of %d tokens of one request runs eager: no compiled step takes it "
                            "(counted in eager_forwards)", len(tokens))
        if self.config._attn_implementation == PACKS_OVER:
            with packed_attention(self.config):  # not packed: `attention` (packed_step.py) for every layer
                return self._forward_model(cache, tokens, keep_logits, snap)
        return self._forward_model(cache, tokens, keep_logits, snap)

    def _forward_model(self, cache, tokens, keep_logits, snap) -> ForwardResult:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, L]
        keep = keep_logits or len(tokens)
        head_input = None
        kwargs = {}
        if self.layout.layers:
            kwargs["output_hidden_states"] = list(self.layout.layers)
        if self.logit_precision == "fp32":
            # The base model only: the fp32 head replaces the model's own low-precision LM head.
            out = self.model.model(input_ids=ids, cache=cache, use_cache=True, **kwargs)
            logits = self.head.logits(keep)  # [keep, vocab] float32
        elif self.logit_precision == "fp32-top":
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep, **kwargs)
            head_input = self.head.normed(keep)  # [keep, hidden]
            logits = self.head.refine_normed(out.logits[0], head_input)  # [keep, vocab] float32
        else:
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep, **kwargs)
            logits = out.logits[0].float()  # [keep, vocab]
        hidden = None
        if self.layout.layers:
            hidden = self.layout.concat(out.hidden_states)[0]  # [L, width]
        return ForwardResult(logits=logits, hidden=hidden, linear_snapshot=snap, head_input=head_input)

    def _forward_compiled(self, cache, tokens, keep_logits, shape, width, argmax_only: bool = False) -> ForwardResult:
        """`_forward_model` through the compiled graph `shape`, tokens padded with their last to `width`."""
        past, fed = cache.get_seq_length(), len(tokens)
        first = () if past else no_keys(self.config, self.model.dtype, self.device)  # a prompt's first chunk: the layers' first buffers
        buffers = [layer.room(past + width, *first) for layer in cache.layers]  # (keys, values) [1, kv_heads, C, D]
        ids = torch.tensor([tokens + tokens[-1:] * (width - fed)], dtype=torch.long, device=self.device)
        positions = torch.arange(past, past + width, device=self.device)[None]  # [1, width]
        last, states = self.compiled.run_shape(shape, ids, positions, causal_mask(past, width).to(self.device),
                                               [keys for keys, _ in buffers], [values for _, values in buffers])
        for layer in cache.layers:
            layer.hold(past + fed)  # the padding's keys stay beyond what the layer holds
        keep = keep_logits or fed
        normed = self.model.model.norm(last[:, fed - keep:fed])[0]  # [keep, hidden]; the fp32 head's hook captures
        logits, head_input = self._logits_at(normed, None, argmax_only)  # the norm's input (the last layer's output)
        hidden = states[0, :fed] if self.layout.layers else None  # [fed, width]
        return ForwardResult(logits=logits, hidden=hidden, head_input=head_input, compiled=True)

    def prefill(self, cache: DynamicCache, prompt_ids: list[int], keep_logits: int = 1) -> ForwardResult:
        """Process the prompt; logits for its last `keep_logits` positions (by default the last only)."""
        return self.forward(cache, prompt_ids, keep_logits=keep_logits)

    def verify(self, cache: DynamicCache, anchor: int, draft: list[int], argmax_only: bool = False) -> ForwardResult:
        """Score `[anchor, d_1..d_gamma]`: row i is the target's distribution after d_i (row 0 after the anchor);
        `argmax_only` as `forward`'s."""
        return self.forward(cache, [anchor, *draft], rollback=bool(draft), argmax_only=argmax_only)

    @property
    def batches_requests(self) -> bool:
        """Whether requests' verify blocks can share a forward (`verify_batch`): full-attention layers only,
        attended with SDPA (what packed_sdpa reproduces)."""
        return (not self.has_sliding_layers and not self.linear and batchable(self.new_cache())
                and self.config._attn_implementation == PACKS_OVER)

    @property
    def shares_chunks(self) -> bool:
        """Whether a prompt's chunk should share a forward with other requests' verify blocks (`verify_batch`'s
        `chunk`). Not with the prompt-chunk graph built: no graph takes a chunk and blocks together, and the two
        graphs one after the other measure faster than one eager forward of both (scripts/chunk_beside_rounds.py,
        docs/status.md)."""
        return self.compiled is None or self.compiled.chunk_shape not in self.compiled.graphs

    @torch.inference_mode()
    def verify_batch(self, caches: list[DynamicCache], blocks: list[list[int]],
                     chunk: tuple[DynamicCache, list[int]] | None = None) -> list[ForwardResult]:
        """One forward over several requests' blocks (`[anchor, d_1..d_gamma]` each, lengths may differ) and
        optionally a prompt's next `chunk` (its cache, its tokens): result b is what `verify(caches[b], *blocks[b])`
        gives, up to float rounding; the chunk's result comes last, with its last position's logits (what
        `prefill` gives). A forward that raises leaves every cache as it was."""
        if self.compiled is not None and chunk is None:
            graph = self.compiled.batch_graph(len(blocks), max(len(block) for block in blocks),
                                              sum(len(block) for block in blocks))
            if graph is not None:
                return self._verify_batch_compiled(caches, blocks, *graph)
        if self.compiled is not None:
            self.eager_batches += 1
        rows = caches + ([chunk[0]] if chunk else [])
        tokens = blocks + ([chunk[1]] if chunk else [])
        lengths = [len(row) for row in tokens]
        step = PackedStep(rows, lengths, [False] * len(blocks) + [True] * bool(chunk), self.last_batch, self.device)
        self.last_batch = None
        ids = torch.tensor([[t for row in tokens for t in row]], dtype=torch.long, device=self.device)  # [1, N]
        kwargs = {"output_hidden_states": list(self.layout.layers)} if self.layout.layers else {}
        # A 4-D mask is taken as given; packed_sdpa builds each row's own and never reads this one.
        unread_mask = torch.ones(1, 1, ids.shape[1], 1, dtype=torch.bool, device=self.device)
        snap = step.snapshot()
        try:
            with packed_attention(self.model.config):
                out = self.model.model(input_ids=ids, attention_mask=unread_mask, cache=step, use_cache=True,
                                       position_ids=step.position_ids(self.device), packed_step=step, **kwargs)
        except BaseException:
            step.restore(snap)
            raise
        self.last_batch = step.batch
        keep = [n if b < len(blocks) else 1 for b, n in enumerate(lengths)]  # a chunk: its last position only
        cols = torch.tensor([o + n - k + i for o, n, k in zip(step.offsets, lengths, keep) for i in range(k)],
                            device=self.device)  # [K] packed positions whose logits are wanted
        select = (torch.zeros_like(cols), cols)
        logits, head_input = self._logits_at(out.last_hidden_state[select], select)
        logits = logits.split(keep)  # [keep_b, vocab] each
        head_inputs = head_input.split(keep) if head_input is not None else [None] * len(rows)
        hidden = [None] * len(rows)
        if self.layout.layers:
            states = self.layout.concat(out.hidden_states)[0]  # [N, width]
            hidden = [states[o:o + n] for o, n in zip(step.offsets, lengths)]
        return [ForwardResult(logits=lg, hidden=h, head_input=hi) for lg, h, hi in zip(logits, hidden, head_inputs)]

    def _verify_batch_compiled(self, caches: list[DynamicCache], blocks: list[list[int]], shape,
                               width: int) -> list[ForwardResult]:
        """`verify_batch` of several requests' blocks through the batched graph `shape` (one token each: a plain
        step under load; more: their verify blocks), each row padded with its last token to `width`, over
        `BatchedKV`'s rows (laid out again only when the batch changes)."""
        lengths = [len(block) for block in blocks]
        batch = BatchedKV(caches, lengths, width, list(range(len(caches))), self.last_batch)
        self.last_batch = None
        buffers = batch.buffers()  # (keys, values) [B, kv_heads, capacity, head_dim] per layer
        ids = torch.tensor([block + block[-1:] * (width - len(block)) for block in blocks], dtype=torch.long,
                           device=self.device)  # [B, width]
        last, states = self.compiled.run_shape(shape, ids, batch.position_ids(self.device),
                                               batch.attention_mask(self.device), [keys for keys, _ in buffers],
                                               [values for _, values in buffers])  # [B, width, hidden], [.., width']
        batch.hold()  # only now: a graph that raises leaves every request's layers as they were
        self.last_batch = batch
        real = (torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], device=self.device),
                torch.tensor([i for n in lengths for i in range(n)], device=self.device))  # each row's fed positions
        # The real positions as one sequence: the fp32 head's hook captures the norm's input [1, N, hidden].
        normed = self.model.model.norm(last[real][None])[0]  # [N, hidden]
        logits, head_input = self._logits_at(normed, None)
        head_inputs = head_input.split(lengths) if head_input is not None else [None] * len(caches)
        hidden = states[real].split(lengths) if self.layout.layers else [None] * len(caches)  # [n_b, width'] each
        return [ForwardResult(logits=lg, hidden=h, head_input=hi, compiled=True)
                for lg, h, hi in zip(logits.split(lengths), hidden, head_inputs)]

    def _logits_at(self, normed: torch.Tensor, select, argmax_only: bool = False) -> tuple[torch.Tensor,
                                                                                        torch.Tensor | None]:
        """[N, vocab] float32 logits from final-norm outputs `normed` [N, hidden] (of a batched forward, or the
        last positions of a compiled one), in this runner's logit precision (`select`: where they came from in a
        batched forward, for the fp32 head; None: the last N positions captured), and the fp32 final-norm output
        behind them where they were refined ([N, hidden]; else None). `argmax_only` (one row): the int8 head's
        logits, exact at the argmax (argmax_head.py)."""
        if self.logit_precision == "fp32":
            return self.head.logits(len(normed), select), None
        if argmax_only and self.argmax_head is not None and len(normed) == 1:
            head_input = self.head.normed(1, select)
            low, columns = self.argmax_head.logits(normed, head_input)
            self.argmax_rows += 1
            return self.head.exact_columns(low, columns, head_input), head_input
        low = self.model.get_output_embeddings()(normed)  # [N, vocab]
        if self.logit_precision == "fp32-top":
            head_input = self.head.normed(len(normed), select)
            return self.head.refine_normed(low, head_input), head_input
        return soft_cap(low, getattr(self.config, "final_logit_softcapping", None)).float(), None

    def linear_states(self, cache: DynamicCache, position: int) -> LinearStates | None:
        """The committed state of the layout's `state_layers` in `cache`, which holds positions 0..position-1
        (None: none wanted, or nothing in the cache yet)."""
        layers = list(self.layout.state_layers)
        if not layers or position == 0:
            return None
        conv, recurrent = self.linear.committed(cache, layers)
        return LinearStates(position=position, layers=layers, conv=conv, recurrent=recurrent)

    def rollback(self, cache: DynamicCache, rejected: int, result: ForwardResult) -> None:
        """Drop the last `rejected` positions (the drafts verification did not accept).

        With sliding-window layers crop runs every round, crop(0) included: it is also what trims
        their recorded past back to the window. Hybrid targets restore and replay their linear layers."""
        if result.linear_snapshot is not None:
            if rejected > 0:
                self.linear.rollback(cache, result.linear_snapshot, rejected)
        elif rejected > 0 or self.has_sliding_layers:
            cache.crop(-rejected)
