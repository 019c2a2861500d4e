"""Logit rules (target_worker/logit_rules.py): logit bias, presence/frequency/repetition penalties and min_tokens
applied at every verified position with the output as of that position. Checked against a per-position reference
written out token by token, and end to end: greedy decoding with rules in every mode equals plain greedy decoding
with the same rules on the target alone, with rounds that accept and reject drafts."""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.protocol.messages import SamplingParams
from foresight.target_worker.logit_rules import LogitRules
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import plain_greedy, tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]
RULES = {
    "penalties": dict(presence_penalty=0.7, frequency_penalty=0.4),
    "repetition": dict(repetition_penalty=1.6),
    "bias": dict(logit_bias=[(11, 4.0), (12, -100.0), (30, 2.5)]),
    "min_tokens": dict(min_tokens=12, logit_bias=[(95, 8.0)]),  # eos (95) favoured, held back for 12 tokens
    "all": dict(presence_penalty=-0.3, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=[(20, 3.0)],
                min_tokens=10),
}


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], rules: dict, stop: list[int]) -> torch.Tensor:
    """One position's ruled logits [vocab] after `output`, written out token by token (vLLM's order)."""
    out = logits.float().clone()
    if len(output) < rules.get("min_tokens", 0):
        for token in stop:
            out[token] = float("-inf")
    for token, bias in rules.get("logit_bias", []):
        out[token] += bias
    penalty = rules.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output) if penalty != 1 else ():
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    for token in set(output):
        out[token] -= rules.get("frequency_penalty", 0.0) * output.count(token) + rules.get("presence_penalty", 0.0)
    return out


def ruled_greedy(model, prompt: list[int], max_new: int, rules: dict, eos: int) -> list[int]:
    """Plain greedy decoding with the rules: a full forward per token, the reference rules, the argmax."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        token = int(reference(logits, prompt, out, rules, [eos]).argmax())
        out.append(token)
        if token == eos:
            break
    return out


@pytest.mark.parametrize("name", RULES)
def test_every_row_gets_the_rules_as_of_its_position(name):
    """Row i of a verified block is ruled as if drafts 1..i were output (the only case in which it is used)."""
    gen = torch.Generator().manual_seed(0)
    vocab, prompt, output, draft = 96, [1, 2, 3, 2, 9], [4, 9, 4, 5, 63, 7, 8, 9, 10, 11], [4, 12, 4, 30]
    logits = torch.randn(len(draft) + 1, vocab, generator=gen) * 3
    rules = LogitRules.of(SamplingParams(**RULES[name]), prompt, [95, 62])
    got = rules.apply(logits, output, draft)
    for i in range(len(draft) + 1):
        want = reference(logits[i], prompt, output + draft[:i], RULES[name], [95, 62])
        torch.testing.assert_close(got[i], want)
    assert not torch.equal(got, logits)


def test_no_rules_means_none_are_applied():
    assert LogitRules.of(SamplingParams(temperature=0.7, top_p=0.9), [1, 2], [3]) is None


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", varied=True)


@pytest.mark.parametrize("mode", ["ar", "ngram", "sync", "pipelined"])
@pytest.mark.parametrize("name", ["all", "repetition", "min_tokens"])
def test_greedy_decoding_with_rules_equals_ruled_plain_greedy_in_every_mode(model, mode, name):
    """The oracle drafter proposes the target's greedy text without the rules (cut at random places): rounds
    reject what the rules changed, and the output is still plain greedy decoding's with the rules."""
    eos = model.config.eos_token_id
    want = ruled_greedy(model, PROMPT, 40, RULES[name], eos)
    assert want != plain_greedy(model, PROMPT, 40, eos=eos)  # the rules change the text
    if name == "min_tokens":
        early = ruled_greedy(model, PROMPT, 40, {"logit_bias": RULES[name]["logit_bias"]}, eos)
        assert early[-1] == eos and len(early) <= 12 < len(want) and want[-1] == eos  # held back, then ends
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=5), proposer=OracleForesight(model, cuts=3),
                             foresight_to_completion=True)
    try:
        got = engine.generate(PROMPT, 40, mode=mode, temperature=0.0, **RULES[name])
    finally:
        engine.close()
    assert got["error"] is None
    assert got["tokens"] == want
    if mode in ("sync", "pipelined"):
        drafted = [r for r in got["rounds"] if r.drafted]
        assert any(r.accepted < r.drafted for r in drafted) and any(r.accepted > 0 for r in drafted)


def test_a_banned_token_ends_drafts_before_it():
    from foresight.spec.sampling import banned_tokens, drafts_before_banned

    banned = banned_tokens([(7, -100.0), (8, -99.5), (9, -250.0), (10, 5.0)])
    assert banned == {7, 9}
    assert drafts_before_banned([1, 2, 9, 7], banned) == 2
    assert drafts_before_banned([1, 2, 3], banned) == 3 and drafts_before_banned([7], frozenset()) == 1


@pytest.mark.parametrize("mode", ["ngram", "sync", "pipelined"])
def test_drafters_never_send_a_token_the_bias_bans_and_the_output_is_unchanged(model, mode):
    """The oracle proposes the target's unruled greedy text, which holds the banned token: every block (the
    drafter's, and the target's own prompt lookup) ends before it, and the output is ruled plain greedy's."""
    eos = model.config.eos_token_id
    plain = plain_greedy(model, PROMPT, 40, eos=eos)
    ban = max(set(plain) - {eos}, key=plain.count)  # the token the drafts would hold most often
    rules = {"logit_bias": [(ban, -100.0)]}
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=5),
                             proposer=OracleForesight(model, cuts=3), foresight_to_completion=True)
    sent: list[list[int]] = []
    send, local = engine.drafter.send_to_target.send, engine.target.local_drafts
    engine.drafter.send_to_target.send = lambda msg: (sent.append(getattr(msg, "tokens", [])), send(msg))[1]
    engine.target.local_drafts = lambda state: (sent.append(local(state)), sent[-1])[1]
    try:
        got = engine.generate(PROMPT + plain[:6], 40, mode=mode, temperature=0.0, **rules)
        want = ruled_greedy(model, PROMPT + plain[:6], 40, rules, eos)
    finally:
        engine.close()
    assert got["error"] is None and got["tokens"] == want
    assert ban not in want and any(sent) and not any(ban in block for block in sent)
