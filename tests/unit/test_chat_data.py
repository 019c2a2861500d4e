"""Chat training data on a tiny random model: the seeded request plan, cleaning, decontamination, the
answered (and followed-up) chat stream, resuming from the saved requests; draft-model initialisation."""
from __future__ import annotations

import json

import pytest
import torch

from foresight.models.draft_model import DraftConfig, DraftModel, SharedWeights
from foresight.training.chat_data import REQUESTS_FILE, chat_requests, label_chat
from foresight.training.corpus import Decontaminator, chat_eval_texts
from foresight.training.draft_init import initialise, validate_init
from foresight.training.labelling import DataDir, LabelSettings, Labeller
from foresight.training.self_instruct import TEMPLATES, WRITTEN_KINDS, clean_written, plan, request_from
from support.tiny_models import VOCAB, tiny_model
from support.toy_text import toy_decode, toy_encode, toy_encode_text

torch.set_num_threads(1)
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_plan_is_seeded_and_covers_every_kind():
    a, b = plan(200, seed=3), plan(200, seed=3)
    assert a == b and plan(200, seed=4) != a
    kinds = {it["kind"] for it in a}
    assert kinds == set(WRITTEN_KINDS) | set(TEMPLATES)
    assert {it["source"] for it in a} == {"written", "template", "passage"}
    assert 0.1 < sum(it["follow_up"] is not None for it in a) / len(a) < 0.4
    arithmetic = next(it for it in a if it["kind"] == "arithmetic")
    assert "{" not in request_from(arithmetic, None).messages[0]["content"]


def test_cleaning_written_requests():
    assert clean_written('Question: "How do volcanoes form?"\n6. Why is the sky blue?') == "How do volcanoes form?"
    assert clean_written("6. A) How do you keep basil alive indoors?") == "How do you keep basil alive indoors?"
    assert clean_written("5,200,000 words.") is None  # too short to be a request
    assert clean_written("Sure, here is a question about volcanoes.") is None  # an assistant's voice
    assert clean_written("How do volcanoes form and why do some") is None  # cut off
    assert clean_written("ok") is None
    assert clean_written("x" * 50, passage=True) is None  # passages need a few sentences


def test_requests_never_contain_an_evaluation_request():
    short = next(t for t in chat_eval_texts() if len(t.split()) < 13)
    decon = Decontaminator([], whole_short=chat_eval_texts())
    assert not decon.clean(f"Please help. {short} Thanks.")
    assert decon.clean("Explain how tides work in simple terms.")


def test_chat_stream_answers_follow_ups_and_resumes(tmp_path, target):
    settings = LabelSettings(layers=LAYERS, topk=4, max_len=300, min_len=10, shard_tokens=600, batch_size=2,
                             regen_batch=4, regen_max_new=12)
    header = {"target_name": "tiny", "layers": LAYERS, "topk": 4}
    data = DataDir(tmp_path, header)
    labeller = Labeller(target, settings)
    requests = chat_requests(labeller, data, toy_encode, toy_encode_text, toy_decode, 24, seed=0, eos=[VOCAB - 1],
                             decontaminator=Decontaminator([]))
    assert (tmp_path / REQUESTS_FILE).is_file() and 0 < len(requests) <= 24
    assert data.meta["chat_requests"]["kept"] == len(requests)
    sources = {r.source for r in requests}
    assert "template" in sources and "written" in sources  # toy text passes cleaning
    label_chat(labeller, data, requests[:8], toy_encode, toy_decode, [VOCAB - 1], 0, max_tokens=None)
    st = data.stream("chat")
    assert st["items_done"] == 8 and st["sequences"] >= 1
    assert sum(data.meta["chat_kinds"].values()) >= st["tokens"]
    again = DataDir(tmp_path, header)
    reread = chat_requests(labeller, again, toy_encode, toy_encode_text, toy_decode, 24, seed=0, eos=[VOCAB - 1])
    assert [r.messages for r in reread] == [r.messages for r in requests]  # read back, not rewritten
    label_chat(Labeller(target, settings), again, reread, toy_encode, toy_decode, [VOCAB - 1], 0, max_tokens=None)
    assert again.stream("chat")["items_done"] == len(requests)
    assert json.loads((tmp_path / "meta.json").read_text())["streams"]["chat"]["shards"][:len(st["shards"])] == st["shards"]


def test_follow_up_conversations_hold_two_answers(tmp_path, target):
    settings = LabelSettings(layers=LAYERS, topk=4, max_len=400, min_len=10, shard_tokens=10_000, batch_size=2,
                             regen_batch=2, regen_max_new=8)
    data = DataDir(tmp_path, {"target_name": "tiny", "layers": LAYERS, "topk": 4})
    from foresight.training.self_instruct import ChatRequest

    one = ChatRequest([{"role": "user", "content": "Explain tides."}], "explanation", "template")
    two = ChatRequest([{"role": "user", "content": "Explain rain."}], "explanation", "template", "Why is that?")
    label_chat(Labeller(target, settings), data, [one, two], toy_encode, toy_decode, [VOCAB - 1], 0, None)
    from safetensors.torch import load_file

    shard = load_file(str(tmp_path / data.stream("chat")["shards"][0]))
    off = shard["offsets"].tolist()
    first, second = shard["tokens"][off[0]:off[1]].tolist(), shard["tokens"][off[1]:off[2]].tolist()
    follow = toy_encode([{"role": "user", "content": "Why is that?"}])
    answer1 = toy_encode([{"role": "assistant", "content": ""}])[:2]  # the assistant turn's opening ids

    def find(seq, part):
        return next((i for i in range(len(seq) - len(part) + 1) if seq[i:i + len(part)] == part), -1)

    assert find(first, follow) < 0
    at = find(second, follow)
    assert at > len(toy_encode(two.messages, True))  # after the first request ...
    assert find(second[:at], answer1) > 0  # ... and the first answer
    assert len(second) > at + len(follow) + 1  # the second answer follows


def _draft(target, layers: int) -> DraftModel:
    cfg = DraftConfig.for_target(target.config, target_layers=LAYERS, num_layers=layers, block_size=4)
    return DraftModel(cfg, SharedWeights.from_target(target))


def test_init_from_target_layers_and_from_a_checkpoint(tmp_path, target):
    model = _draft(target, 2)
    info = initialise(model, target, "target")
    top = target.model.layers[-1]
    assert info["target_layers"] == [len(target.model.layers) - 2, len(target.model.layers) - 1]
    assert torch.equal(model.layers[1].q_proj.weight, top.self_attn.q_proj.weight.float())
    assert torch.equal(model.layers[1].down_proj.weight, top.mlp.down_proj.weight.float())
    model.save(tmp_path / "ckpt")
    deeper = _draft(target, 3)
    info = initialise(deeper, target, validate_init(str(tmp_path / "ckpt")))
    assert torch.equal(deeper.layers[0].q_proj.weight, model.layers[0].q_proj.weight.half().float())
    assert info["fresh"] and all(k.startswith("layers.2.") for k in info["fresh"])
    with pytest.raises(ValueError, match="init"):
        validate_init(str(tmp_path / "nowhere"))
