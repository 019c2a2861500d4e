"""Logprobs are the target's, whatever drafted: through the official openai client, one fp32 server per mode, the
same requests (greedy and seeded T=1) give the same tokens with the same logprobs and top alternatives in `ar`,
`ngram`, `sync`, `pipelined` and `auto`."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
MODES = ("ar", "ngram", "sync", "pipelined", "auto")
ASKS = [({"role": "user", "content": "Write a Python function that checks whether a number is prime."}, 0.0, None),
        ({"role": "user", "content": "Give me three tips for a rainy weekend."}, 1.0, 11)]
TOLERANCE = 1e-4  # fp32 forwards of different shapes (a verify block, a plain step) agree to ~1e-6


@pytest.fixture(scope="module")
def answers(module_server_factory) -> dict[str, list]:
    """Per mode, per ask: [(token, logprob, {alternative: logprob})] of the answer."""
    out = {}
    for mode in MODES:
        with module_server_factory("--dtype", "float32", "--mode", mode) as server:
            client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
            out[mode] = [entries(client.chat.completions.create(
                model=MODEL, messages=[message], max_tokens=32, temperature=temperature, seed=seed, logprobs=True,
                top_logprobs=3)) for message, temperature, seed in ASKS]
    return out


def entries(response) -> list[tuple[str, float, dict[str, float]]]:
    return [(e.token, e.logprob, {t.token: t.logprob for t in e.top_logprobs})
            for e in response.choices[0].logprobs.content]


@pytest.mark.parametrize("mode", MODES[1:])
def test_logprobs_equal_ar_s(answers, mode):
    for want, got in zip(answers["ar"], answers[mode]):
        assert [token for token, _, _ in got] == [token for token, _, _ in want]
        for (_, lp_got, top_got), (_, lp_want, top_want) in zip(got, want):
            assert lp_got == pytest.approx(lp_want, abs=TOLERANCE)
            assert top_got.keys() == top_want.keys()
            assert all(top_got[t] == pytest.approx(v, abs=TOLERANCE) for t, v in top_want.items())
