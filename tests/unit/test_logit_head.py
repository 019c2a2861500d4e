"""fp32 logits for a low-precision target: the final norm and LM head in fp32, or its near-maximum entries."""
import pytest
import torch

from foresight.target_worker.logit_head import Fp32LogitHead, needs_fp32_head
from foresight.target_worker.runner import TargetRunner
from support.tiny_models import tiny_model

torch.set_num_threads(1)
IDS = torch.randint(1, 90, (1, 12), generator=torch.Generator().manual_seed(3))


def softcapped(arch: str):
    model = tiny_model(arch)
    if arch == "gemma3":
        model.config.final_logit_softcapping = 3.0  # exercised: the head must re-apply it
    return model


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])
def test_fp32_head_reproduces_the_models_own_logits_in_fp32(arch):
    model = softcapped(arch)
    head = Fp32LogitHead(model)  # forced: an fp32 model does not need it, so it must match exactly
    with torch.inference_mode():
        want = model(IDS).logits[0]
        model.model(IDS)
        got = head.logits(IDS.shape[1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])
def test_bf16_target_decides_on_fp32_logits(arch):
    model = softcapped(arch).to(torch.bfloat16)
    assert needs_fp32_head(model) and not needs_fp32_head(softcapped(arch))
    full, top, low = (TargetRunner(model, logits=p) for p in ("fp32", "fp32-top", "model"))
    prompt = IDS[0].tolist()
    rows = {}
    for name, runner in (("fp32", full), ("fp32-top", top), ("model", low)):
        rows[name] = runner.prefill(runner.new_cache(), prompt).logits  # [1, vocab]
        cache = runner.new_cache()
        runner.prefill(cache, prompt[:6])
        rows[name + "/verify"] = runner.verify(cache, prompt[6], prompt[7:]).logits  # [6, vocab]
    for key in ("", "/verify"):
        exact, refined, coarse = rows["fp32" + key], rows["fp32-top" + key], rows["model" + key]
        assert exact.dtype == refined.dtype == torch.float32
        # Low-precision logits lie on the bf16 grid; fp32 ones do not.
        assert torch.equal(coarse, coarse.bfloat16().float())
        assert not torch.equal(exact, exact.bfloat16().float())
        # Refinement recomputes the decisive entries: the argmax and the maximum equal the full fp32 head's.
        assert torch.equal(refined.argmax(-1), exact.argmax(-1))
        torch.testing.assert_close(refined.max(-1).values, exact.max(-1).values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(exact, coarse, atol=0.3, rtol=0.05)  # the same model, finer rounding


def test_unknown_logit_precision_is_refused():
    with pytest.raises(ValueError, match="logits"):
        TargetRunner(tiny_model("llama"), logits="fp64")


def bf16_prefills(varied: bool = False, keep: int = 1):
    """A bf16 tiny model's prefill of IDS through the full fp32 head and through the near-maximum refinement: the
    exact logits of the last `keep` positions, the refined forward's result, and its runner."""
    model = tiny_model("llama", varied=varied).to(torch.bfloat16)
    full, top = TargetRunner(model, logits="fp32"), TargetRunner(model, logits="fp32-top")
    prompt = IDS[0].tolist()
    exact = full.prefill(full.new_cache(), prompt, keep_logits=keep).logits  # [keep, vocab]
    return exact, top.prefill(top.new_cache(), prompt, keep_logits=keep), top


def test_logit_rules_that_move_the_maximum_are_decided_in_fp32():
    """A logit bias lifts the 20th-best token to the top: its ruled logit is its fp32 logit plus the bias (as
    the full fp32 head gives), not its bf16 one; without the second refinement it would be the bf16 value."""
    from functools import partial

    from foresight.protocol.messages import SamplingParams
    from foresight.target_worker.logit_rules import LogitRules

    prompt = IDS[0].tolist()
    exact, result, top = bf16_prefills()  # [1, vocab] each
    order = exact[0].argsort(descending=True)
    lifted, gap = int(order[19]), float(exact[0, order[0]] - exact[0, order[19]])
    rules = partial(LogitRules.of(SamplingParams(logit_bias=[(lifted, gap + 0.01)]), prompt, []).apply,
                    output_ids=[], draft=[])
    once = rules(result.logits)  # the rules over the first refinement only
    twice = top.head.refine_ruled(result.logits, result.head_input, rules)
    want = rules(exact)
    assert int(want.argmax()) == lifted and int(twice.argmax()) == lifted
    torch.testing.assert_close(twice[0, lifted], want[0, lifted], atol=1e-5, rtol=1e-5)
    assert not torch.equal(once[0, lifted], want[0, lifted])  # the lifted token was a bf16 value before


def test_exact_columns_recomputes_just_the_named_entries_in_fp32():
    """What logprobs report of a bf16 target (target_worker/logprobs.py): the named entries equal the full fp32
    head's, every other entry is left as it was."""
    exact, result, top = bf16_prefills(varied=True, keep=IDS.shape[1])  # [12, vocab] each
    columns = torch.tensor([[5, 60], [7, 7]] + [[1, 2]] * 10)  # [12, 2], a repeat included
    got = top.head.exact_columns(result.logits, columns, result.head_input)
    named = torch.zeros_like(got, dtype=torch.bool).scatter_(-1, columns, True)
    torch.testing.assert_close(got[named], exact[named], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~named], result.logits[~named])
    assert not torch.equal(result.logits[named], exact[named])  # they were not fp32 before


@pytest.mark.parametrize("keeps_max", [True, False], ids=["max-allowed", "max-forbidden"])
def test_a_grammar_mask_is_decided_on_fp32_logits(keeps_max):
    """A grammar mask alone (steps.grammar_only): the allowed maximum is decided on its fp32 logit, whether the mask
    keeps the row's maximum (the runner's refinement covers it) or forbids it and the 20th-best token is the best
    allowed (refined again)."""
    from foresight.target_worker.steps import grammar_only

    exact, result, top = bf16_prefills()  # [1, vocab] each
    order = exact[0].argsort(descending=True)
    allowed = torch.zeros_like(exact, dtype=torch.bool)
    kept = order[[0, 5, 9]] if keeps_max else order[19:40]
    allowed[0, kept] = True
    got = grammar_only(result, allowed, top.head)
    best = int(kept[0])
    assert int(got.argmax()) == best and torch.isinf(got[~allowed]).all()
    torch.testing.assert_close(got[0, best], exact[0, best], atol=1e-5, rtol=1e-5)
    if not keeps_max:
        assert not torch.equal(result.logits[0, best], exact[0, best])  # a bf16 value before the second refinement
