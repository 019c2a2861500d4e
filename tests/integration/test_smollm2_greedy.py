"""Speculative greedy output on the real default model equals plain greedy decoding, token for token.

fp32 on CPU, where a (gamma+1)-token verify and a 1-token step agree to rounding that never flips
an argmax in practice (bf16 on a GPU needs the near-tie treatment described in docs/architecture.md).
"""
from __future__ import annotations

import pytest
import torch

from foresight.config import EngineConfig
from foresight.models.loading import load_target, load_tokenizer, prepare_default_model
from support.inprocess import InProcessEngine

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the days of the week, one per line.",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"",
]


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(2)
    path = prepare_default_model()
    model = load_target(path, torch.float32, "cpu")
    tok = load_tokenizer(path)
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=8))
    yield model, tok, engine
    engine.close()


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sync_greedy_equals_hf_greedy(setup, prompt):
    model, tok, engine = setup
    ids = chat_ids(tok, prompt)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
    got = engine.generate(ids, 64, mode="sync", temperature=0.0)
    assert got["error"] is None
    assert got["tokens"] == ref
    rounds = got["rounds"]
    assert sum(r.drafted for r in rounds) > 0
