"""TargetRunner: what it checks when it is built, and the target states it returns (rollback: test_rollback.py)."""
import pytest
import torch

from foresight.protocol.messages import HiddenLayout
from foresight.target_worker.runner import TargetRunner
from support.tiny_models import tiny_model

torch.set_num_threads(1)


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
