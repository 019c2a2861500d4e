"""`foresight serve --tensor-parallel-size 3` on the real default (SmolLM2-135M: 9 heads, 3 KV heads, split in
three ranks on the CPU, gloo): the official client's greedy completions, streamed or not, are plain greedy
decoding's, token for token (fp32), with the shipped drafter's blocks verified on the split target; the other
ranks are the target worker's children and leave with it."""
from __future__ import annotations

import openai
import pytest
import torch

from foresight.models.loading import load_target, load_tokenizer, prepare_default_model
from support.live_server import pid_exists, wait_health

pytestmark = pytest.mark.integration

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colours are"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def greedy_texts() -> list[str]:
    path = prepare_default_model()
    model, tok = load_target(path, torch.float32, "cpu"), load_tokenizer(path)
    texts = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:]
            texts.append(tok.decode(out, skip_special_tokens=True))
    return texts


def rank_children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def test_a_target_split_in_three_serves_plain_greedy_text(server_factory, greedy_texts):
    # sync, at least one draft a round: every round verifies a block of the shipped drafter on the split target
    with server_factory("--tensor-parallel-size", "3", "--dtype", "float32", "--mode", "sync", "--verify-length",
                        "prefix") as server:
        target = wait_health(server, 200)["workers"]["target"]
        ranks = rank_children(target)
        assert len(ranks) == 2, ranks
        client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        plain = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert plain.choices[0].text == greedy_texts[0]
        spec = plain.usage.model_extra["speculation"]
        assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0, spec
        stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == greedy_texts[1]
        assert "target split over 3 ranks (cpu, cpu, cpu)" in server.log()
    assert not [pid for pid in [target, *ranks] if pid_exists(pid)]
