"""llguidance against xgrammar on the embedded default's tokenizer: tokenizer set-up, schema compile and the mask of
every position of a valid JSON answer (the choice behind server/structured.py; numbers in docs/status.md).

    .venv/bin/pip install xgrammar apache-tvm-ffi --no-deps   # not a dependency of the project (it pulls triton)
    .venv/bin/python scripts/grammar_engines.py
"""
from __future__ import annotations

import json
import time

from foresight.models.loading import load_tokenizer, resolve_target

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "address": {"type": "object", "properties": {
                                               "city": {"type": "string"},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                       "required": ["city", "zip"]}},
          "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "12345"}}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def walk(fill, allowed, take, ids: list[int]) -> list[float]:
    """Seconds of each mask along `ids`, checking every token is allowed where it stands."""
    times = []
    for token in ids:
        _, seconds = timed(fill)
        times.append(seconds)
        assert allowed(token) and take(token), token
    return times


def report(name: str, setup_s: float, compile_s: float, times: list[float]) -> None:
    times = sorted(times)
    print(f"{name}: tokenizer {setup_s * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, mask mean "
          f"{sum(times) / len(times) * 1e3:.3f} ms, p50 {times[len(times) // 2] * 1e3:.3f}, max {times[-1] * 1e3:.3f}")


def llguidance_run(tok, vocab: int, schema: dict, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lt, setup_s = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema)))
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = walk(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0),
                 lambda t: bool((mask[0, t // 32] >> (t % 32)) & 1), matcher.consume_token, ids)
    report(f"llguidance {json.dumps(schema)[:30]}", setup_s, compile_s, times)


def xgrammar_run(tok, vocab: int, schema: dict, ids: list[int]) -> None:
    import xgrammar

    compiler, setup_s = timed(lambda: xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(
        tok, vocab_size=vocab)))
    matcher, compile_s = timed(lambda: xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema))))
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    times = walk(lambda: matcher.fill_next_token_bitmask(mask), lambda t: bool((mask[0, t // 32] >> (t % 32)) & 1),
                 matcher.accept_token, ids)
    report(f"xgrammar {json.dumps(schema)[:30]}", setup_s, compile_s, times)


def main() -> None:
    tok = load_tokenizer(resolve_target(None))
    vocab = len(tok)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False) + [tok.eos_token_id]
    print(f"{len(ids)} tokens of a valid answer, vocabulary {vocab}")
    for schema in (SCHEMA, {"type": "object"}):
        llguidance_run(tok, vocab, schema, ids)
        try:
            xgrammar_run(tok, vocab, schema, ids)
        except ImportError:
            print("xgrammar is not installed (see the docstring)")


if __name__ == "__main__":
    main()
