"""Structured output in verification (target_worker/grammar.py): each verified row is masked by the grammar's state
after the output and the drafts before it, so greedy output with a grammar equals plain greedy decoding under the
same grammar, token for token, in every mode (with drafts the grammar rejects), seeded sampling gives the same text
in every mode, and every output parses and validates against its schema."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from foresight.config import EngineConfig
from foresight.server.structured import ANY_OBJECT, compiled
from foresight.target_worker.grammar import GrammarState, grammar_tokenizer
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import VOCAB, tiny_char_tokenizer, tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]
EOS = VOCAB - 1
SCHEMAS = {
    "object": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                                "s": {"type": "string", "maxLength": 6},
                                                "ok": {"type": "boolean"}},
               "required": ["n", "s", "ok"], "additionalProperties": False},
    "enum-array": {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["up", "down"]},
                                                           "minItems": 1, "maxItems": 4}},
                   "required": ["xs"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", varied=True)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_char_tokenizer()


@torch.inference_mode()
def masked_greedy(model, tokenizer, grammar: str, max_new: int) -> list[int]:
    """Reference: a full forward per token, then the most likely token the grammar accepts (checked one candidate at
    a time with a matcher of its own), until eos or until the grammar is complete and takes nothing more (where the
    engine ends the request too: plain decoding could only add the eos)."""
    import llguidance

    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, VOCAB, [EOS]), grammar)
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([PROMPT + out])).logits[0, -1]
        token = next(int(t) for t in logits.argsort(descending=True) if allows(matcher, int(t)))
        assert matcher.consume_token(token)
        out.append(token)
        if token == EOS or matcher.is_stopped():
            break
    return out


def allows(matcher, token: int) -> bool:
    """Whether the grammar takes `token` next: eos once the grammar is complete, else a token it can consume."""
    return matcher.is_accepting() if token == EOS else matcher.validate_tokens([token]) == 1


class ScriptOracle(OracleForesight):
    """Drafts a known text (the masked greedy output), one token in some drafts replaced by the next id (most often
    one the grammar forbids there), so rounds accept drafts and the grammar rejects some."""

    def __init__(self, model, script: list[int]):
        super().__init__(model, cuts=3)
        self.script = script

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        done = tokens[len(PROMPT):]
        if tokens[:len(PROMPT)] != PROMPT or done != self.script[:len(done)]:
            return super().greedy(tokens, n)
        return (self.script[len(done):] + [EOS] * n)[:n]


def run(model, tokenizer, mode: str, grammar: str, script: list[int] | None = None, **sampling) -> dict:
    proposer = OracleForesight(model, cuts=3) if script is None else ScriptOracle(model, script)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=5), proposer=proposer,
                             foresight_to_completion=True, tokenizer=tokenizer)
    try:
        return engine.generate(PROMPT, 80, mode=mode, grammar=grammar, **sampling)
    finally:
        engine.close()


def without_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


def parsed(tokenizer, tokens: list[int]):
    return json.loads(tokenizer.decode(without_eos(tokens)))


@pytest.mark.parametrize("mode", ["ar", "ngram", "sync", "pipelined"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_greedy_output_with_a_grammar_equals_masked_plain_greedy_in_every_mode(model, tokenizer, mode, name):
    grammar = compiled(SCHEMAS[name], "response_format")
    want = masked_greedy(model, tokenizer, grammar, 80)
    jsonschema.validate(parsed(tokenizer, want), SCHEMAS[name])
    got = run(model, tokenizer, mode, grammar, script=want, temperature=0.0)
    assert got["error"] is None
    assert without_eos(got["tokens"]) == without_eos(want)  # a round that ends the grammar may also commit its eos
    if mode in ("sync", "pipelined"):
        drafted = [r for r in got["rounds"] if r.drafted]
        assert any(r.accepted < r.drafted for r in drafted) and any(r.accepted > 0 for r in drafted)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_seeded_sampling_with_a_grammar_is_the_same_in_every_mode_and_valid(model, tokenizer, name):
    grammar = compiled(SCHEMAS[name], "response_format")
    outputs = {mode: without_eos(run(model, tokenizer, mode, grammar, temperature=1.0, seed=9)["tokens"])
               for mode in ("ar", "ngram", "sync")}
    assert outputs["ngram"] == outputs["ar"] == outputs["sync"]
    jsonschema.validate(parsed(tokenizer, outputs["ar"]), SCHEMAS[name])


def test_any_json_object(model, tokenizer):
    got = run(model, tokenizer, "sync", compiled(ANY_OBJECT, "response_format"), temperature=0.0)
    assert isinstance(parsed(tokenizer, got["tokens"]), dict)


def test_masks_stop_at_the_first_forbidden_draft_and_the_verdict_rolls_back(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    state = GrammarState(grammar_tokenizer(tokenizer, VOCAB, [EOS]), compiled(schema, "response_format"), VOCAB)
    ids = tokenizer.encode('{"a": 7}', add_special_tokens=False)
    draft = ids[:3] + tokenizer.encode("x", add_special_tokens=False) + ids[4:6]  # '{"a' then a forbidden 'x'
    rows = state.masks(draft)
    assert [bool(rows[i, draft[i]]) for i in range(4)] == [True, True, True, False]
    assert rows[4:].all()  # after the forbidden draft: never used, left open
    assert state.taken == 3
    state.commit(accepted=2, token=ids[2])  # two drafts kept, then the target's own token
    again = state.masks(ids[3:])
    assert all(bool(again[i, t]) for i, t in enumerate(ids[3:])) and bool(again[len(ids) - 3, EOS])


def test_a_request_with_a_grammar_fails_alone_without_a_tokenizer(model):
    engine = InProcessEngine(model, EngineConfig(drafter="ngram"))
    try:
        got = engine.generate(PROMPT, 8, mode="ar", grammar=compiled(ANY_OBJECT, "response_format"))
        plain = engine.generate(PROMPT, 8, mode="ar", temperature=0.0)
    finally:
        engine.close()
    assert got["error"] and "tokenizer" in got["error"] and plain["error"] is None


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(model, tokenizer):
    """ignore_eos (as load benchmarks send it): once the grammar is complete nothing may follow, so the request
    stops there (finish reason stop) instead of failing on a row the grammar allows nothing in."""
    grammar = compiled(SCHEMAS["object"], "response_format")
    want = masked_greedy(model, tokenizer, grammar, 80)
    got = run(model, tokenizer, "sync", grammar, script=want, temperature=0.0, ignore_eos=True)
    assert got["error"] is None and got["reason"] == "stop" and without_eos(got["tokens"]) == without_eos(want)


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_a_grammar_that_ends_before_min_tokens_ends_the_request(model, tokenizer, mode):
    """min_tokens longer than the JSON: the request ends where the grammar is complete (finish reason stop), with
    the output plain masked decoding gives."""
    grammar = compiled(SCHEMAS["object"], "response_format")
    want = masked_greedy(model, tokenizer, grammar, 80)
    got = run(model, tokenizer, mode, grammar, script=want, temperature=0.0, min_tokens=79)
    assert got["error"] is None and got["reason"] == "stop"
    assert without_eos(got["tokens"]) == without_eos(want) and len(got["tokens"]) < 79


def test_a_row_min_tokens_and_the_grammar_leave_empty_takes_the_grammars_end(tokenizer):
    """The grammar's last token accepted as a draft: the row after it allows only the eos, which min_tokens holds
    back. The grammar wins (the eos stays allowed) instead of a row with no token at all, whose argmax (token 0)
    the grammar then refused (a 500)."""
    from types import SimpleNamespace

    from foresight.protocol.messages import SamplingParams
    from foresight.target_worker.logit_rules import LogitRules
    from foresight.target_worker.steps import ruled

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    state = SimpleNamespace(grammar=GrammarState(grammar_tokenizer(tokenizer, VOCAB, [EOS]),
                                                 compiled(schema, "response_format"), VOCAB),
                            rules=LogitRules.of(SamplingParams(min_tokens=50), PROMPT, [EOS]), output_ids=[])
    draft = tokenizer.encode('{"n": 5}')  # every draft allowed; the row after the last one allows only the eos
    logits = torch.randn(len(draft) + 1, VOCAB)
    out = ruled(state, SimpleNamespace(logits=logits, head_input=None), draft, None)
    assert out[:-1].isfinite().any(-1).all() and not out[:-1, EOS].isfinite().any()  # min_tokens holds
    assert out[-1].isfinite().nonzero().flatten().tolist() == [EOS]
