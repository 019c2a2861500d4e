"""Cache rollback after a verify leaves the target exactly where plain decoding of the kept tokens would."""
import pytest
import torch

from foresight.protocol.messages import HiddenLayout
from foresight.target_worker.runner import TargetRunner
from support.tiny_models import tiny_model

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("rejected", [0, 2, 4])
def test_verify_rollback_then_continue_matches_full_forward(arch, rejected):
    model = tiny_model(arch)
    runner = TargetRunner(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 90, (20,), generator=g).tolist()  # longer than gemma3's window of 8
    anchor, draft, nxt = 7, [11, 12, 13, 14], 21
    cache = runner.new_cache()
    runner.prefill(cache, prompt)
    result = runner.verify(cache, anchor, draft)
    runner.rollback(cache, rejected, result)
    kept = [anchor] + draft[: len(draft) - rejected]
    got = runner.forward(cache, [nxt]).logits[-1]
    with torch.inference_mode():
        want = model(torch.tensor([prompt + kept + [nxt]])).logits[0, -1].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # And the verify logits themselves equal the full forward's rows.
    with torch.inference_mode():
        full = model(torch.tensor([prompt + [anchor] + draft])).logits[0, -5:].float()
    torch.testing.assert_close(result.logits, full, atol=1e-4, rtol=1e-4)


def test_the_layout_must_fit_the_target():
    """A drafter built for another target (another width, or state layers that are not linear attention) is
    refused when the runner is built, not at the first forward."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="width"):
        TargetRunner(model, HiddenLayout((1,), model.config.hidden_size + 1))
    with pytest.raises(ValueError, match="linear-attention"):
        TargetRunner(model, HiddenLayout(state_layers=(1,)))
    runner = TargetRunner(model, HiddenLayout((0, 2), model.config.hidden_size))
    result = runner.prefill(runner.new_cache(), [5, 6, 7])
    with torch.inference_mode():
        states = model(torch.tensor([[5, 6, 7]]), output_hidden_states=True).hidden_states
    assert result.hidden.shape == (3, runner.layout.width)
    torch.testing.assert_close(runner.layout.select(result.hidden, [2]), states[2][0])
