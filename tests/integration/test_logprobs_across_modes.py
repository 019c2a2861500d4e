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
# fp32 forwards of different shapes round differently: the top-3 logprobs of a 48-token chat answer differ by up to
# 6e-5 between 1-token steps and 8-token verify blocks (dense eager target, 1 or 2 threads). A logprob taken from the
# wrong row, temperature or rule differs by orders of magnitude more.
TOLERANCE = 5e-4


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
        worst = (0.0, None)  # the largest difference and where: (position, token)
        for i, ((_, lp_got, top_got), (token, lp_want, top_want)) in enumerate(zip(got, want)):
            assert top_got.keys() == top_want.keys(), (i, token)
            for t, value in [(token, lp_want), *top_want.items()]:
                gap = abs((lp_got if t == token else top_got[t]) - value)
                worst = max(worst, (gap, (i, t)), key=lambda w: w[0])
        assert worst[0] <= TOLERANCE, f"{mode}: logprob differs by {worst[0]:.2e} from ar's at (position, token) " \
                                      f"{worst[1]}"
