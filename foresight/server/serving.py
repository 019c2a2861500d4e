"""Turning one validated OpenAI request into engine outputs: prompt building, streaming chunks, usage.

This is the api's per-request path: tokenize -> GenerateRequest -> TokenOutputs -> detokenize ->
SSE chunks (or one JSON body), recording the request's metrics on the way.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..protocol.messages import GenerateRequest, RoundStats, SamplingParams, TokenOutput
from .chat_prompt import ContentNotKept, added_token_texts, chat_prompt_ids, holds_control_text
from .detokenizer import IncrementalDetokenizer
from .engine_client import EngineClient, RequestError
from .logprobs import TokenTexts
from .openai_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from .structured import Structure, StructureError, structure_of, template_input
from .tool_formats import JSON_TOOLS, ToolFormat

log = logging.getLogger("foresight.server")

# Temperatures below this are greedy (as in vLLM): dividing logits by 1e-40 overflows to inf and the
# sampled distribution becomes NaN, while any T this small is argmax in all but name.
GREEDY_BELOW = 1e-5


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def max_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (an upper bound: a byte-level
    symbol or a byte-fallback token like <0xE2> is never shorter than what it decodes to)."""
    try:
        return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)
    except Exception:  # a tokenizer without a listable vocabulary: no bound from it
        return 0


def _chars(body) -> tuple[int, str]:
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) + len(m.role) for m in body.messages), "messages"
    prompt = single_prompt(body)
    return (len(prompt) if isinstance(prompt, str) else 0), "prompt"


def single_prompt(body: CompletionRequest) -> str | list[int]:
    """A completions prompt: its text, or its token ids (a list of one text is that text)."""
    prompt = body.prompt
    return prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else prompt


@dataclass
class SpecTally:
    """Per-request speculation statistics, reported in the usage object."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    nucleus_extra: int = 0
    committed: int = 0
    lookups: int = 0
    hits: int = 0
    exposed_s: list[float] = field(default_factory=list)
    strategies: dict[str, int] = field(default_factory=dict)  # rounds per strategy (mode auto's choices)

    def add(self, stats: RoundStats, committed: int) -> None:
        self.rounds += 1
        self.strategies[stats.strategy] = self.strategies.get(stats.strategy, 0) + 1
        self.committed += committed
        self.draft_tokens += stats.drafted
        self.accepted_tokens += stats.accepted
        self.nucleus_extra += stats.nucleus_extra
        if stats.cache_hit is not None:
            self.lookups += 1
            self.hits += int(stats.cache_hit)
        if stats.exposed_draft_s is not None:
            self.exposed_s.append(stats.exposed_draft_s)

    @classmethod
    def combined(cls, tallies: list["SpecTally"]) -> "SpecTally":
        """The statistics of several requests (the choices of one) as one."""
        if len(tallies) == 1:
            return tallies[0]
        out = cls()
        for t in tallies:
            out.rounds += t.rounds
            out.draft_tokens += t.draft_tokens
            out.accepted_tokens += t.accepted_tokens
            out.nucleus_extra += t.nucleus_extra
            out.committed += t.committed
            out.lookups += t.lookups
            out.hits += t.hits
            out.exposed_s += t.exposed_s
            for strategy, n in t.strategies.items():
                out.strategies[strategy] = out.strategies.get(strategy, 0) + n
        return out

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.committed / self.rounds if self.rounds else None,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "nucleus_extra_accepted_tokens": self.nucleus_extra,
            "cache_hit_rate": self.hits / self.lookups if self.lookups else None,
            "exposed_draft_ms_mean": 1e3 * sum(self.exposed_s) / len(self.exposed_s) if self.exposed_s else None,
            "strategy_rounds": dict(self.strategies),
        }


@dataclass(slots=True)
class Piece:
    """What one engine output adds to a request's answer."""

    text: str  # new text that is safe to send (detokenizer.py)
    reason: str | None  # the finish reason, on the last piece
    tally: SpecTally  # the request's speculation statistics so far
    n_completion: int  # tokens generated so far
    output: TokenOutput  # the engine's: its token ids and, when asked for, their logprobs and the prompt's
    kept: int = 0  # of output.token_ids, those in the answer (a stop string may end it before the last)

    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids[:self.kept]

    @property
    def logprobs(self):
        return self.output.logprobs.head(self.kept) if self.output.logprobs is not None else None


class RequestRunner:
    """Builds engine requests from OpenAI bodies and turns outputs back into OpenAI responses."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str, max_model_len: int, metrics=None,
                 max_prompt_chars: int | None = None, special_tokens_in_content: bool = False,
                 tool_format: ToolFormat = JSON_TOOLS):
        """`special_tokens_in_content`: control-token text in chat messages becomes control tokens (chat_prompt.py);
        `tool_format`: how tools are described and calls written (tool_formats.py)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        if max_prompt_chars is None and tokenizer is not None:
            max_prompt_chars = max_model_len * max_token_chars(tokenizer) or None
        self.max_prompt_chars = max_prompt_chars  # None: no bound known
        # One thread: a Hugging Face tokenizer is not safe to use from several threads at once, and
        # tokenizing (or templating) a long prompt must not stall the event loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foresight-tokenize")
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None  # logprobs' token strings
        self.split_special = not special_tokens_in_content
        self.controls = added_token_texts(tokenizer) if tokenizer is not None else []
        self.tool_format = tool_format

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ building the request

    def check_prompt_size(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Refuse text no context could hold, before paying for tokenizing it."""
        n, param = _chars(body)
        if self.max_prompt_chars is not None and n > self.max_prompt_chars:
            raise BadRequest(f"the prompt has {n} characters, more than {self.max_model_len} tokens (this "
                             f"model's context length) can hold", param)

    async def tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], str]:
        """`prompt_ids` in the tokenizer thread, after the size check."""
        self.check_prompt_size(body)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prompt_ids, body)

    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], str]:
        if isinstance(body, ChatCompletionRequest):
            return self._chat_ids(body), "messages"
        prompt = single_prompt(body)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False) or [self.tokenizer.eos_token_id], "prompt"
        if len(prompt) >= self.max_model_len:
            return list(prompt), "prompt"  # build() refuses it with the lengths; no vocabulary scan needed
        if any(t < 0 or t >= len(self.tokenizer) for t in prompt):
            raise BadRequest("prompt token ids must lie in the vocabulary", "prompt")
        return list(prompt), "prompt"

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        from jinja2 import TemplateError

        messages, tools = template_input(body, self.tool_format)
        if self.split_special and self.tool_format.native:
            self._check_no_control_text(messages, tools)
        try:
            return chat_prompt_ids(self.tokenizer, messages, self.split_special, self.controls, tools)
        except ContentNotKept as exc:
            raise BadRequest(f"messages hold control-token text, and {exc}", "messages")
        except TemplateError as exc:  # the template's own verdict, e.g. "roles must alternate"
            raise BadRequest(f"messages could not be formatted with the chat template: {exc}", "messages")
        except Exception:
            log.warning("chat template failed on a request's messages", exc_info=True)
            raise BadRequest("messages could not be formatted with the chat template", "messages")

    def _check_no_control_text(self, messages: list[dict], tools: list[dict] | None) -> None:
        """A template that knows tools writes their definitions and the calls given back as they are: control-token
        text there could close a turn and forge another, so it is refused (message contents are split instead)."""
        calls = [m["tool_calls"] for m in messages if "tool_calls" in m]
        for value, param in ((tools, "tools"), (calls, "messages")):
            if value and holds_control_text(json.dumps(value, ensure_ascii=False), self.controls):
                raise BadRequest(f"{param} hold control-token text (one of the tokenizer's added tokens)", param)

    def build(self, body: SamplingFields, prompt_ids: list[int], prompt_param: str,
              req_id: str | None = None, structure: Structure | None = None) -> GenerateRequest:
        """The engine request of `body` (`structure`: its structure_of, when the caller has it already)."""
        n_prompt = len(prompt_ids)
        if n_prompt >= self.max_model_len:
            raise BadRequest(f"the prompt has {n_prompt} tokens; this model's context length is "
                             f"{self.max_model_len} tokens", prompt_param)
        max_tokens = body.max_tokens if body.max_tokens is not None else self.max_model_len - n_prompt
        if max_tokens == 0 and not getattr(body, "echo", None):
            raise BadRequest("max_tokens may be 0 only with echo: true (to score the prompt)", "max_tokens")
        logprobs, prompt_logprobs = logprob_counts(body)
        if n_prompt + max_tokens > self.max_model_len:
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                             f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} to generate)",
                             "max_tokens")
        if body.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        bias = list({int(token): value for token, value in (body.logit_bias or {}).items()}.items())  # "07" is 7
        self._check_token_ids([token for token, _ in bias], "logit_bias")
        self._check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        cfg = self.engine.cfg
        temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
        sampling = SamplingParams(
            temperature=temperature, top_p=body.top_p, top_k=max(body.top_k, 0), seed=body.seed,
            verification=body.verification or cfg.verification,
            nucleus_threshold=body.nucleus_threshold if body.nucleus_threshold is not None else cfg.nucleus_threshold,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias, min_tokens=body.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            grammar=(structure if structure is not None else self.structure(body)).grammar)
        return GenerateRequest(req_id=req_id or f"{prompt_param[:4]}-{uuid.uuid4().hex[:16]}", prompt_ids=prompt_ids,
                               max_tokens=max_tokens, sampling=sampling, ignore_eos=body.ignore_eos,
                               stop_token_ids=list(body.stop_token_ids or []))

    def echo_text(self, body: CompletionRequest, prompt_ids: list[int]) -> str:
        """The prompt as completions' echo returns it: as sent, or its token ids decoded."""
        prompt = single_prompt(body)
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def structure(self, body: SamplingFields) -> Structure:
        """What the output must be (response_format, tools), its grammar compiled (structured.py)."""
        try:
            return structure_of(body, self.tool_format)
        except StructureError as exc:
            raise BadRequest(str(exc), exc.param) from None

    def build_choices(self, body: SamplingFields, prompt_ids: list[int], prompt_param: str, req_id: str,
                      structure: Structure) -> list[GenerateRequest]:
        """One engine request per choice (`n`): choice i is request `req_id`-i (choice 0: `req_id`), seeded
        `seed` + i when the body has a seed (else each draws its own)."""
        first = self.build(body, prompt_ids, prompt_param, req_id, structure)
        choices = [first]
        for i in range(1, body.n):
            seed = None if body.seed is None else (body.seed + i) % 2**63
            choices.append(replace(first, req_id=f"{req_id}-{i}", sampling=replace(first.sampling, seed=seed)))
        return choices

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        if any(t >= len(self.tokenizer) for t in ids):
            raise BadRequest(f"{param}: token ids must lie in the vocabulary (below {len(self.tokenizer)})", param)

    # ------------------------------------------------------------------ running it

    async def events(self, request: GenerateRequest, stop: list[str]) -> AsyncIterator[Piece]:
        """One `Piece` per engine output."""
        detok = IncrementalDetokenizer(self.tokenizer, stop)
        tally = SpecTally()
        start = last = time.perf_counter()
        n_tokens = 0
        if self.metrics:
            self.metrics.record_prompt_tokens(len(request.prompt_ids))
        reason = None
        try:
            async for out in self.engine.generate(request):
                now = time.perf_counter()
                self._record_timing(n_tokens, now - start, now - last)
                last = now
                text = detok.add(out.token_ids, final=out.finished)
                n_tokens += detok.kept  # a stop string ends the answer at the token that completed it
                for stats in out.rounds:
                    tally.add(stats, len(out.token_ids))
                    if self.metrics:
                        self.metrics.record_round(stats)
                reason = "stop" if detok.stopped else out.finish_reason
                if self.metrics:
                    self.metrics.record_generation_tokens(detok.kept)
                yield Piece(text, reason if (out.finished or detok.stopped) else None, tally, n_tokens, out,
                            detok.kept)
                if detok.stopped:
                    break  # leaving the generator aborts the request in the engine
        except RequestError:
            reason = "error"
            if self.metrics:
                self.metrics.record_failure("worker_error")
            raise
        finally:
            # A client that went away closes this generator early: that request was aborted.
            if self.metrics and reason != "error":
                self.metrics.record_finished(reason or "abort", time.perf_counter() - start)

    def _record_timing(self, n_before: int, since_start: float, since_last: float) -> None:
        if not self.metrics:
            return
        if n_before == 0:
            self.metrics.record_first_token(since_start)
        else:
            self.metrics.record_inter_token(since_last)

    def usage(self, n_prompt: int, n_completion: int, tally: SpecTally) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion, "speculation": tally.to_dict()}


def logprob_counts(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token) the request's logprobs ask for; None: no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None, None
    return body.logprobs, body.logprobs if body.echo else None


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"
