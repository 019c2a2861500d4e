"""Logprobs (target_worker/logprobs.py): a request's token logprobs are the target's at the positions that decided
them, the same in every mode (greedy and seeded sampling, rounds that accept and reject drafts), equal to a
teacher-forced forward over the output; the prompt's logprobs (completions' echo) equal a teacher-forced forward
over the prompt, chunked prefill or not, with nothing generated at max_tokens 0; "processed" logprobs are those of
the ruled, temperature-scaled distribution."""
from __future__ import annotations

import math

import pytest
import torch

from foresight.config import EngineConfig
from foresight.protocol.messages import TokenLogprobs
from foresight.target_worker.logprobs import score
from support.inprocess import InProcessEngine
from support.oracle_proposer import OracleForesight
from support.tiny_models import tiny_model

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41, 3]
MODES = ["ar", "ngram", "sync", "pipelined"]
TOP = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", varied=True)


@torch.inference_mode()
def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of one full forward (no cache): row j is the distribution after ids[:j + 1]."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def joined(parts: list[TokenLogprobs]) -> TokenLogprobs:
    return TokenLogprobs.join(parts)


def assert_scores(got: TokenLogprobs, rows: torch.Tensor, tokens: list[int]) -> None:
    """`got` holds, per token, its logprob under rows[i] and that row's TOP most likely (ids and values)."""
    assert len(got) == len(tokens) == rows.shape[0]
    want_values = rows.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got.values), want_values, atol=1e-5, rtol=0)
    top = rows.topk(TOP, -1)
    torch.testing.assert_close(torch.tensor(got.top_values), top.values, atol=1e-5, rtol=0)
    assert got.top_ids == top.indices.tolist()


def run(model, mode: str, max_tokens: int = 30, cfg: EngineConfig | None = None, **sampling) -> dict:
    engine = InProcessEngine(model, cfg or EngineConfig(drafter="ngram", block_size=5),
                             proposer=OracleForesight(model, cuts=3), foresight_to_completion=True)
    try:
        return engine.generate(PROMPT, max_tokens, mode=mode, **sampling)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_output_logprobs_are_the_targets_at_each_position_in_every_mode(model, mode, sampling):
    got = run(model, mode, logprobs=TOP, **sampling)
    assert got["error"] is None and got["tokens"]
    rows = teacher_forced(model, PROMPT + got["tokens"])[len(PROMPT) - 1:-1]  # the rows that decided them
    assert_scores(joined(got["logprobs"]), rows, got["tokens"])
    if sampling["temperature"] == 0:
        assert [ids[0] for ids in joined(got["logprobs"]).top_ids] == got["tokens"]  # greedy: each is its row's top
    if mode in ("sync", "pipelined"):
        drafted = [r for r in got["rounds"] if r.drafted]
        assert any(r.accepted < r.drafted for r in drafted) and any(r.accepted > 0 for r in drafted)
    if mode != "ar":
        assert any(len(part) > 1 for part in got["logprobs"])  # rounds that committed several tokens


def test_no_logprobs_unless_asked(model):
    got = run(model, "sync", max_tokens=8, temperature=0.0)
    assert got["logprobs"] == [] and got["prompt_logprobs"] is None


@pytest.mark.parametrize("chunk", [256, 6], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_a_teacher_forced_forward(model, chunk):
    cfg = EngineConfig(drafter="ngram", block_size=5, max_num_batched_tokens=chunk)
    got = run(model, "sync", max_tokens=4, cfg=cfg, temperature=0.0, logprobs=TOP, prompt_logprobs=TOP)
    rows = teacher_forced(model, PROMPT)[:-1]
    assert_scores(got["prompt_logprobs"], rows, PROMPT[1:])
    assert len(got["tokens"]) == 4


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(model):
    got = run(model, "ar", max_tokens=0, temperature=0.0, prompt_logprobs=0)
    assert got["tokens"] == [] and got["reason"] == "length" and got["error"] is None
    rows = teacher_forced(model, PROMPT)[:-1]
    want = rows.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got["prompt_logprobs"].values), want, atol=1e-5, rtol=0)
    assert got["prompt_logprobs"].top_ids == [[]] * (len(PROMPT) - 1)


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_processed_logprobs_are_the_ruled_scaled_distribution(model, mode):
    """With a logit bias and a temperature, "processed" logprobs are the log_softmax of the ruled logits over T."""
    cfg = EngineConfig(drafter="ngram", block_size=5, logprobs_mode="processed")
    forbidden = int(teacher_forced(model, PROMPT)[-1].argmax())
    got = run(model, mode, max_tokens=12, cfg=cfg, temperature=0.8, seed=3, logprobs=TOP,
              logit_bias=[(forbidden, -100.0), (17, 2.0)])
    assert got["error"] is None
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + got["tokens"]])).logits[0, len(PROMPT) - 1:-1]
    logits = logits.float().clone()  # outside inference mode: editable
    logits[:, forbidden] -= 100.0
    logits[:, 17] += 2.0
    rows = torch.log_softmax(logits / 0.8, -1)
    assert_scores(joined(got["logprobs"]), rows, got["tokens"])
    assert forbidden not in got["tokens"]


def test_score_reports_minus_infinity_for_impossible_tokens():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    got = score(logits, [1], 2)
    assert got.values == [-math.inf] and got.top_ids == [[2, 0]]


def test_batched_steps_keep_each_requests_logprobs(model):
    """Requests served together (one forward verifies every block, prompts prefilled in chunks between them):
    the logprobs of each are its own, and a prompt whose logprobs are wanted still gets every position's."""
    cfg = EngineConfig(drafter="ngram", block_size=5, max_num_batched_tokens=8)
    engine = InProcessEngine(model, cfg, proposer=OracleForesight(model, cuts=5), foresight_to_completion=True)
    prompts = [PROMPT, PROMPT[3:] + [11, 12], list(reversed(PROMPT))]
    try:
        ids = [engine.submit(prompts[0], 20, mode="sync", temperature=0.0, logprobs=TOP),
               engine.submit(prompts[1], 20, mode="ngram", temperature=0.0, logprobs=TOP, prompt_logprobs=TOP),
               engine.submit(prompts[2], 20, mode="sync", temperature=1.0, seed=1)]
        results = engine.collect(ids)
    finally:
        engine.close()
    for prompt, rid in zip(prompts[:2], ids):
        got = results[rid]
        rows = teacher_forced(model, prompt + got["tokens"])[len(prompt) - 1:-1]
        assert_scores(joined(got["logprobs"]), rows, got["tokens"])
    assert_scores(results[ids[1]]["prompt_logprobs"], teacher_forced(model, prompts[1])[:-1], prompts[1][1:])
    assert results[ids[2]]["logprobs"] == [] and results[ids[2]]["tokens"]


@pytest.mark.parametrize("mode", ["ar", "sync"])
def test_a_bf16_target_reports_its_fp32_heads_logprobs(mode):
    """bf16: the verify logits are fp32 only near the maximum; logprobs come from the fp32 head over every token.
    They match a teacher-forced forward through the same head (to bf16 rounding of the body, which differs between
    forward shapes), and at T=0 each committed token is its row's most likely."""
    from foresight.target_worker.logit_head import Fp32LogitHead

    model = tiny_model("llama", varied=True).to(torch.bfloat16)
    got = run(model, mode, max_tokens=20, temperature=0.0, logprobs=TOP)
    assert got["error"] is None
    reference = tiny_model("llama", varied=True).to(torch.bfloat16)  # the runner hooks its own model's norm
    head = Fp32LogitHead(reference)
    ids = PROMPT + got["tokens"]
    with torch.inference_mode():
        reference(torch.tensor([ids]))
        rows = torch.log_softmax(head.logits(len(ids)), -1)[len(PROMPT) - 1:-1]
    lp = joined(got["logprobs"])
    torch.testing.assert_close(torch.tensor(lp.values), rows.gather(-1, torch.tensor(got["tokens"])[:, None])[:, 0],
                               atol=0.05, rtol=0)
    assert [ids[0] for ids in lp.top_ids] == got["tokens"]
