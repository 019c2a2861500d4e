"""The int8 LM head for rows decided by their argmax (target_worker/argmax_head.py): its bound holds on every entry,
the refined argmax is the fp32 head's (near-ties included, where the int8 logits alone pick wrong), and the target
worker gives it only the rounds of greedy requests whose other logits nobody reads; greedy decoding through it on
compiled steps equals greedy decoding on the model's own head."""
import pytest
import torch

from foresight.config import EngineConfig
from foresight.models.compiled_step import CompiledStep
from foresight.target_worker.argmax_head import ArgmaxHead
from foresight.target_worker.logit_head import Fp32LogitHead
from foresight.target_worker.packed_step import packed_attention
from support.inprocess import InProcessEngine
from support.tiny_models import tiny_model

torch.set_num_threads(1)
TRIALS = 300


@pytest.fixture
def model():  # one per test: a logit head hooks the final norm, which compiling must not trace
    """A tiny bf16 Llama whose head has pairs of rows, larger than the rest (so they often hold the maximum), one bf16
    step apart in one weight: their int8 codes are equal, near-ties only the fp32 refinement separates."""
    model = tiny_model("llama", varied=True).to(torch.bfloat16)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight  # [vocab, hidden]
        for a in range(10, 40, 2):
            weight[a] *= 1.5
            weight[a + 1] = weight[a]
            weight[a + 1, a % weight.shape[1]] = torch.nextafter(weight[a, a % weight.shape[1]].float(),
                                                                 torch.tensor(1.0)).bfloat16()
    return model


def states(hidden: int, trial: int) -> torch.Tensor:
    """A final-norm output [1, hidden] fp32 with a few outlier dimensions, as real models have."""
    gen = torch.Generator().manual_seed(trial)
    h = torch.randn(1, hidden, generator=gen)
    h[0, torch.randint(0, hidden, (3,), generator=gen)] *= 20
    return h


def test_every_logit_lies_within_its_bound_and_the_argmax_is_the_fp32_heads(model):
    fp32 = Fp32LogitHead(model)
    head = ArgmaxHead(fp32.weight_low)
    near_tie_errors = 0
    for trial in range(TRIALS):
        h = states(model.config.hidden_size, trial)
        low = h.bfloat16()
        exact = h @ fp32.weight.T  # [1, vocab]
        logits, columns = head.logits(low, h)
        bounds = head.bounds(logits, low, h)  # [1, vocab] E_v
        assert ((exact - logits).abs() <= bounds).all(), trial
        top = int(logits.argmax())
        wanted = (logits[0] >= logits[0, top] - bounds[0, top] - bounds[0]).nonzero()[:, 0]
        assert torch.equal(columns[0].sort().values, wanted), trial  # the two passes find every qualifying column
        refined = fp32.exact_columns(logits, columns, h)
        assert int(refined.argmax()) == int(exact.argmax()), trial
        near_tie_errors += int(logits.argmax()) != int(exact.argmax())
    assert near_tie_errors > 0  # the int8 logits alone pick another token now and then: the refinement decides


def engine_tokens(model, compiled, requests: list[dict]) -> tuple[list[list[int]], int]:
    engine = InProcessEngine(model, EngineConfig(drafter="ngram", block_size=4), compiled=compiled)
    try:
        got = [engine.generate([5, 6, 7, 8, 9, 40, 41, 3], 24, mode="ar", **request) for request in requests]
        rows = engine.target.runner.argmax_rows
    finally:
        engine.close()
    assert all(result["error"] is None for result in got)
    return [result["tokens"] for result in got], rows


def test_greedy_rounds_on_compiled_steps_take_the_int8_head_and_decode_the_same(model, tmp_path):
    """Greedy `ar` on compiled steps (its rounds through the int8 head) equals greedy `ar` on the eager runner (the
    model's own head, refined); a sampled request and one asking for logprobs never use the int8 head."""
    compiled = CompiledStep(model, (), (1,), tmp_path, autotune=False, attention=packed_attention)
    compiled.build()
    greedy = {"temperature": 0.0}
    (want,), _ = engine_tokens(model, None, [greedy])
    (got,), rows = engine_tokens(model, compiled, [greedy])
    assert got == want and rows == len(got) - 1  # every round after the prefill's first token
    _, rows = engine_tokens(model, compiled, [{"temperature": 0.8, "seed": 1}, {"temperature": 0.0, "logprobs": 2},
                                              {"temperature": 0.0, "verification": "nucleus"}])
    assert rows == 0
