"""Drafter training on tiny random models: labelling (shapes, decontamination, resume), block sampling,
the loss going down, the schedule, resumable training, and the offline evaluation loop.

The target is a tiny Llama unless a test asks for another architecture (`@ARCHS`: the hybrid targets,
Qwen3.5 and Qwen3-Next, whose Gated DeltaNet layers keep recurrent state instead of a croppable KV cache);
`data_dir` is then labelled by that target."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from foresight.drafter_worker.jetspec_proposer import JetSpecProposer
from foresight.models.draft_model import DraftModel, SharedWeights
from foresight.target_worker.runner import TargetRunner
from foresight.training.corpus import Conversation, Decontaminator, conversations_from_source, eval_texts
from foresight.training.dataset import LabelledData, choose_vocab_subset, sample_blocks
from foresight.training.draft_init import initialise, validate_init
from foresight.training.eval_drafter import greedy_reference, speculate
from foresight.training.label_store import LabelStore
from foresight.training.labelling import DataDir, LabelSettings, Labeller, label_all, label_shards
from foresight.training.run_files import BUDGET_PROBE, steps_within_budget
from foresight.training.train_drafter import TrainSettings, build_model, kl_loss, lr_at, train, trained_positions
from support.tiny_models import VOCAB, plain_greedy, tiny_model
from support.toy_text import toy_encode

torch.set_num_threads(1)

LAYERS = [1, 3]
HYBRID = ["qwen3_5", "qwen3_next"]  # 3 Gated DeltaNet layers, then 1 full-attention layer
# The tests that run on every target kind: `target` (and with it `data_dir`) parametrised indirectly.
ARCHS = pytest.mark.parametrize("target", ["llama", *HYBRID], indirect=True)
SOURCE = '''
def scale(values, factor=2):
    """Multiply every value by factor and return the new list of values."""
    out = []
    for v in values:
        out.append(v * factor)
    return out


class Box:
    def area(self, width, height):
        """Return the area of a rectangle with the given width and height."""
        result = width * height
        return result
'''


@pytest.fixture(scope="module")
def target(request):
    return tiny_model(getattr(request, "param", "llama"))


@pytest.fixture(scope="module")
def conversations():
    import random

    rng = random.Random(0)
    convs = []
    for i in range(12):
        convs += conversations_from_source(SOURCE.replace("scale", f"scale{i}"), f"mod{i}", rng)
    return convs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target, conversations):
    path = tmp_path_factory.mktemp("data")
    settings = LabelSettings(layers=LAYERS, topk=8, max_len=200, min_len=20, shard_tokens=1500, batch_size=2,
                             regen_max_new=16)
    data = DataDir(path, {"target_name": "tiny", "layers": LAYERS, "topk": 8})
    label_all(Labeller(target, settings), data, conversations, toy_encode, text_tokens=3000, regen_items=2,
              eos=[VOCAB - 1], seed=0)
    return path


def test_corpus_from_source_and_decontamination():
    import random

    convs = conversations_from_source(SOURCE, "mod", random.Random(0))
    kinds = {c.kind for c in convs}
    assert "implement" in kinds
    impl = next(c for c in convs if c.kind == "implement" and "area" in c.source)
    assert impl.messages[0]["role"] == "user" and impl.messages[-1]["role"] == "assistant"
    assert "def area(self, width, height):" in impl.messages[0]["content"]  # dedented stub with the docstring
    assert "result = width * height" in impl.messages[-1]["content"] and "result" not in impl.messages[0]["content"]
    evals = eval_texts()
    assert len(evals) >= 164 * 3, "HumanEval (the evaluation set) must be installed"
    leaked = Conversation([{"role": "user", "content": "Solve this:\n" + evals[0]},
                           {"role": "assistant", "content": "ok"}], "leak", "extra")
    kept, dropped = Decontaminator(evals).filter(convs + [leaked])
    assert dropped == 1 and leaked not in kept and len(kept) == len(convs)


@ARCHS
def test_labelled_shards(data_dir, target):
    meta = json.loads((data_dir / "meta.json").read_text())
    text, regen = meta["streams"]["text"], meta["streams"]["regen"]
    assert text["tokens"] >= 3000 and len(text["shards"]) >= 2
    assert regen["items_done"] == 2 and regen["sequences"] >= 1
    total = 0
    for name in text["shards"] + regen["shards"]:
        shard = load_file(str(data_dir / name))
        n = shard["tokens"].shape[0]
        total += n
        assert shard["offsets"][0] == 0 and shard["offsets"][-1] == n
        assert shard["hidden"].shape == (n, len(LAYERS) * target.config.hidden_size)
        assert shard["hidden"].dtype == torch.float16
        assert shard["topk_ids"].shape == shard["topk_logp"].shape == (n, 8)
        assert (shard["topk_logp"][:, :-1] >= shard["topk_logp"][:, 1:]).all()  # sorted top-k
    assert total == text["tokens"] + regen["tokens"]
    # the stored labels are the target's own: recompute every sequence of a shard alone (labelled two to a
    # padded forward: a right-padded row must not differ, whatever state the target's layers keep)
    shard = load_file(str(data_dir / text["shards"][0]))
    offsets = shard["offsets"].tolist()
    for a, b in zip(offsets[:-1], offsets[1:]):
        ids = shard["tokens"][a:b].long()[None]
        with torch.no_grad():
            out = target(ids, output_hidden_states=LAYERS)
        states = torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)
        torch.testing.assert_close(shard["hidden"][a:b].float(), states, rtol=1e-2, atol=1e-2)
        assert torch.equal(shard["topk_ids"][a:b, 0].long(), out.logits[0].argmax(-1))


def test_labelling_resumes_without_duplicates(tmp_path, target, conversations):
    settings = LabelSettings(layers=LAYERS, topk=4, max_len=200, min_len=20, shard_tokens=800)
    header = {"target_name": "tiny", "layers": LAYERS, "topk": 4}
    data = DataDir(tmp_path, header)
    label_all(Labeller(target, settings), data, conversations, toy_encode, 1000, 0, [VOCAB - 1], 0)
    first = dict(data.stream("text"))
    again = DataDir(tmp_path, header)  # a new run continues after the items already done
    label_all(Labeller(target, settings), again, conversations, toy_encode, 2000, 0, [VOCAB - 1], 0)
    st = again.stream("text")
    assert st["items_done"] > first["items_done"] and st["tokens"] >= 2000
    assert st["shards"][:len(first["shards"])] == first["shards"]
    with pytest.raises(ValueError):
        DataDir(tmp_path, {**header, "topk": 8})


def test_repository_shards_are_labelled_in_order_and_resume_after_an_appended_shard(tmp_path, target):
    """`train drafter --shards data/chat`: every sequence of the token-id shards is teacher-forced once, in the
    store's order; a shard appended later is labelled by the next run and nothing is labelled twice."""
    store = LabelStore(tmp_path / "chat", tmp_path / "pending.jsonl")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist() for n in (30, 41, 25, 60, 33)]

    def append(sequences, first):
        for i, seq in enumerate(sequences):
            store.add({"item": first + i, "tokens": seq, "kind": "t", "sampled": False, "dropped": None})
        store.pack()

    append(seqs[:3], 0)
    settings = LabelSettings(layers=LAYERS, topk=4, max_len=200, min_len=20, shard_tokens=50)
    header = {"target_name": "tiny", "layers": LAYERS, "topk": 4}
    label_shards(Labeller(target, settings), DataDir(tmp_path / "labels", header), tmp_path / "chat")
    append(seqs[3:], 3)
    label_shards(Labeller(target, settings), DataDir(tmp_path / "labels", header), tmp_path / "chat")
    data = LabelledData(tmp_path / "labels")
    assert [data.seq_tokens(i).tolist() for i in range(len(data))] == seqs
    stream = data.meta["streams"]["shards_chat"]
    assert stream["items_done"] == 5 and stream["tokens"] == sum(map(len, seqs))
    with torch.no_grad():
        logits = target(torch.tensor(seqs[4])[None]).logits[0]
    assert torch.equal(data.read(4, "topk_ids", 0, len(seqs[4]))[:, 0].long(), logits.argmax(-1))


def test_block_sampling(data_dir):
    data = LabelledData(data_dir)
    subset_index = torch.arange(VOCAB)
    batch = sample_blocks(data, torch.Generator().manual_seed(0), n_seqs=3, n_anchors=4, block=8, window=32,
                          subset_index=subset_index)
    s, q = batch.tokens.shape
    assert (s, q) == (3, 32)
    assert batch.mask.shape == (3, 32, batch.ctx_states.shape[1] + 32)
    assert batch.target_ids.shape == (3, 32, 8)
    # every block's inputs: the anchor is a true token; clean prefix m < block - 1; context strictly before the anchor
    for row in range(s):
        for a in range(4):
            sl = slice(a * 8, a * 8 + 8)
            n = int(batch.positions[row, a * 8])
            m = int(batch.clean[row, a * 8])
            assert 0 <= m <= 6
            ctx_pos = batch.ctx_positions[row][batch.mask[row, a * 8, :batch.ctx_states.shape[1]]]
            assert len(ctx_pos) and ctx_pos.max() == n - 1 and ctx_pos.min() >= n - 32
            assert batch.ctx_positions[row, batch.anchor_index[row, a * 8]] == n - 1
            assert torch.equal(batch.positions[row, sl], n + torch.arange(8))
    torch.testing.assert_close(batch.weights[0, :3], torch.tensor([1.0, 0.8, 0.64]))
    again = sample_blocks(data, torch.Generator().manual_seed(0), 3, 4, 8, 32, subset_index)
    assert torch.equal(again.tokens, batch.tokens)  # seeded



def test_a_blocks_first_positions_train_as_in_the_whole_block(data_dir, target):
    """Output i of a block reads only its inputs <= i: the first P queries of each block, kept alone (what
    `loss_positions` trains), score as they do inside the whole block."""
    data = LabelledData(data_dir)
    s = TrainSettings(num_layers=2, block_size=8, context_window=32, vocab_subset=0, seed=0)
    model = build_model(target, data, s).eval()
    batch = sample_blocks(data, torch.Generator().manual_seed(2), 3, 4, 8, 32, torch.arange(VOCAB))
    keep = batch.block_idx[0] < 5  # [Q] the first 5 positions of each of the 4 blocks
    t = batch.ctx_states.shape[1]
    mask = torch.cat([batch.mask[:, keep, :t], batch.mask[:, keep, t:][:, :, keep]], dim=-1)
    with torch.no_grad():
        whole = model.forward_blocks(batch.ctx_states.float(), batch.ctx_positions, batch.tokens, batch.block_idx,
                                     batch.positions, batch.anchor_index, batch.mask)
        first = model.forward_blocks(batch.ctx_states.float(), batch.ctx_positions, batch.tokens[:, keep],
                                     batch.block_idx[:, keep], batch.positions[:, keep], batch.anchor_index[:, keep],
                                     mask)
    torch.testing.assert_close(first, whole[:, keep], rtol=1e-5, atol=1e-5)


def test_loss_positions_train_short_blocks_of_a_whole_size_model(data_dir, target, tmp_path):
    assert trained_positions(TrainSettings(block_size=16)) == 16
    assert trained_positions(TrainSettings(block_size=16, loss_positions=8)) == 8
    for bad in (2, 17):
        with pytest.raises(ValueError, match="loss_positions"):
            trained_positions(TrainSettings(block_size=16, loss_positions=bad))
    s = TrainSettings(steps=2, num_layers=1, block_size=8, loss_positions=4, context_window=32, vocab_subset=0,
                      batch_seqs=2, anchors=2, bf16=False, ckpt_every=100)
    report = train(target, LabelledData(data_dir), tmp_path, s, log=lambda *_: None)
    assert report["steps_done"] == 2
    model = DraftModel.load(tmp_path, SharedWeights.from_target(target))
    assert model.config.block_size == 8 and model.block_pos.num_embeddings == 8


def test_a_warm_start_keeps_the_checkpoints_jacobi_passes(data_dir, target, tmp_path):
    s = dict(steps=1, num_layers=1, block_size=8, context_window=32, vocab_subset=0, batch_seqs=2, anchors=2,
             bf16=False, ckpt_every=100)
    train(target, LabelledData(data_dir), tmp_path / "a", TrainSettings(**s), log=lambda *_: None)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["default_passes"] == 1  # DraftConfig's default
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "default_passes": 0}))
    train(target, LabelledData(data_dir), tmp_path / "b", TrainSettings(init=str(tmp_path / "a"), **s),
          log=lambda *_: None)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["default_passes"] == 0

def test_resident_labels_are_loaded_once_per_device(data_dir):
    """The sampler's resident copy: sequences at their offsets, and loaded once per device whatever object
    names it (on CUDA, 'cuda' vs the tensors' 'cuda:0' once caused a reload per step: 40x slower training;
    only a GPU run can exercise that spelling)."""
    data = LabelledData(data_dir)
    res = data.resident("cpu")
    assert data.resident(torch.device("cpu")) is res
    assert res.hidden.shape[0] == res.tokens.shape[0] == data.num_tokens
    for i in (0, len(data) - 1):
        start, n = int(res.starts[i]), data.index[i][2]
        assert torch.equal(res.tokens[start:start + n].long(), data.seq_tokens(i))
        assert torch.equal(res.hidden[start:start + n], data.read(i, "hidden", 0, n))


def test_vocab_subset(data_dir):
    data = LabelledData(data_dir)
    subset = choose_vocab_subset(data, VOCAB, 40)
    assert subset is not None and len(subset) == 40 and torch.equal(subset, subset.sort().values)
    assert choose_vocab_subset(data, VOCAB, 0) is None


def test_lr_schedule():
    s = TrainSettings(steps=100, warmup=10, lr=1e-3)
    assert lr_at(0, s) == pytest.approx(1e-4)
    assert lr_at(10, s) == lr_at(74, s) == pytest.approx(1e-3)
    assert lr_at(87, s) < 1e-3 and lr_at(99, s) < 1e-5


def test_time_budget_fixes_the_step_count():
    bar = SimpleNamespace(total=None, write=lambda *_: None)
    s = TrainSettings(steps=1000, time_budget_s=10.0)
    # 31 steps done in 3.1 s at 0.1 s/step: 6.9 s left fit 69 more
    assert steps_within_budget(s, 31, 0.1, 3.1, bar) == 100 and bar.total == 100
    assert steps_within_budget(s, 31, 0.001, 3.1, bar) == 1000  # never more than asked for
    assert steps_within_budget(s, 31, 0.1, 12.0, bar) == 31  # over budget already: stop now
    # a later window runs faster: the count grows again up to what was asked for
    s.steps = 100
    assert steps_within_budget(s, 61, 0.01, 6.1, bar, cap=1000) == 61 + 390


def test_time_budget_is_refitted_until_the_decay(data_dir, target, tmp_path, monkeypatch):
    """A slow first window must not fix a short run: the step count follows the measured rate."""
    import foresight.training.train_drafter as td

    clock = {"t": 0.0, "step": 0}

    def fake_clock() -> float:  # the first window's steps are 10x slower than the rest
        return clock["t"]

    def slow_then_fast(model, batch, bf16=False):
        clock["t"] += 1.0 if clock["step"] < 1 + BUDGET_PROBE else 0.1
        clock["step"] += 1
        return kl_loss(model, batch, bf16)

    monkeypatch.setattr(td, "time", SimpleNamespace(perf_counter=fake_clock))
    monkeypatch.setattr(td, "kl_loss", slow_then_fast)
    monkeypatch.setattr(td, "save_all", lambda *a, **k: None)
    s = TrainSettings(num_layers=1, block_size=8, context_window=32, vocab_subset=0, steps=400, batch_seqs=1,
                      anchors=1, ckpt_every=10_000, time_budget_s=100.0)
    (tmp_path / "report.json").write_text("{}")
    train(target, LabelledData(data_dir), tmp_path, s)
    # after the slow window (31 s at 1 s/step) the first fit allows 100 steps; the next window runs at
    # 0.1 s/step and the re-fit grows the run to everything asked for (fixed once, it stayed at 100)
    assert s.steps == 400


@ARCHS
def test_training_steps_lower_the_loss(data_dir, target):
    data = LabelledData(data_dir)
    s = TrainSettings(num_layers=1, block_size=8, context_window=32, vocab_subset=0, seed=0)
    model = build_model(target, data, s).train()
    batch = sample_blocks(data, torch.Generator().manual_seed(1), 2, 4, 8, 32, torch.arange(VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(45):
        loss, _ = kl_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@ARCHS
def test_train_resume_matches_uninterrupted_run(data_dir, target, tmp_path):
    data = LabelledData(data_dir)
    s = dict(num_layers=1, block_size=8, context_window=32, vocab_subset=50, batch_seqs=2, anchors=2, warmup=2,
             bf16=False, seed=3)
    straight = train(target, data, tmp_path / "a", TrainSettings(steps=4, ckpt_every=100, **s), log=lambda *_: None)
    train(target, data, tmp_path / "b", TrainSettings(steps=2, ckpt_every=100, **s), log=lambda *_: None)
    with pytest.raises(FileExistsError):
        train(target, data, tmp_path / "b", TrainSettings(steps=4, **s))
    resumed = train(target, data, tmp_path / "b", TrainSettings(steps=4, ckpt_every=100, **s), resume=True,
                    log=lambda *_: None)
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in straight["history"]], rel=1e-5)
    assert (tmp_path / "b" / "loss.png").is_file() and resumed["steps_done"] == 4
    model = DraftModel.load(tmp_path / "b", SharedWeights.from_target(target))
    assert model.config.vocab_subset_size == 50 and model.config.target_layers == LAYERS


@ARCHS
def test_eval_loop_is_lossless_and_counts_rounds(data_dir, target, tmp_path):
    """Greedy speculation through the real round loop gives plain greedy decoding, one entry per round.
    Rejected drafts are rolled back (on a hybrid target: its linear-attention states restored and replayed):
    every verification scores its block as an uncached forward over the whole sequence does. (The tiny
    targets' greedy output repeats the prompt's last token, so the tokens alone would not show a wrong
    state; the logits do.)"""
    data = LabelledData(data_dir)
    model = build_model(target, data, TrainSettings(num_layers=1, block_size=8, context_window=32, vocab_subset=0))
    proposer = JetSpecProposer(model.eval(), passes=1)
    runner = TargetRunner.for_proposer(target, proposer)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    ref, gaps = greedy_reference(runner, prompt, 24, [VOCAB - 1])
    assert ref == plain_greedy(target, prompt, 24, VOCAB - 1)  # the cached reference is the uncached one
    verified = []

    def same_as_uncached(ctx, block, result, verdict):  # ctx.tokens: the committed tokens, the anchor last
        with torch.no_grad():
            fresh = target(torch.tensor([ctx.tokens + block.tokens])).logits[0, -len(block) - 1:]
        torch.testing.assert_close(result.logits, fresh, atol=1e-4, rtol=1e-4)
        verified.append(len(block))

    got = speculate(runner, proposer, prompt, 24, 0.0, 6, 0, [VOCAB - 1], on_verified=same_as_uncached)
    assert got["tokens"] == ref and len(gaps) == len(ref) and len(verified) == len(got["accepted"])
    committed = [a + 1 for a in got["accepted"]]  # per round: the accepted drafts and the target's token
    assert sum(committed) + 1 >= len(ref) > sum(committed[:-1]) + 1  # the prefill's token, then the rounds
    assert any(a < 5 for a in got["accepted"][:-1])  # drafts were rejected and rolled back
    assert speculate(runner, proposer, prompt, 24, 1.0, 6, 5, [VOCAB - 1])["tokens"] == \
        speculate(runner, proposer, prompt, 24, 1.0, 6, 5, [VOCAB - 1])["tokens"]


def test_chat_evaluation_set_is_broad_and_kept_out_of_training():
    from foresight.bench.prompts import chat_prompts, load_prompts
    from foresight.training.corpus import chat_eval_texts

    items = chat_prompts()
    assert len(items) >= 64 and len({i["id"] for i in items}) == len(items)
    assert len({i["category"] for i in items}) >= 11
    assert all(m["content"].strip() and m["role"] in ("user", "assistant") for i in items for m in i["messages"])
    assert all(i["messages"][-1]["role"] == "user" for i in items)
    assert {i["category"] for i in load_prompts("chat", limit=12)} == {i["category"] for i in items}
    short = "Why is the sky blue?"  # 5 words: only the whole-text rule can catch it
    assert short in chat_eval_texts()
    leaked = Conversation([{"role": "user", "content": f"Quick one. {short} Thanks!"},
                           {"role": "assistant", "content": "Rayleigh scattering."}], "leak", "extra")
    unrelated = Conversation([{"role": "user", "content": "Why is the sea salty?"},
                              {"role": "assistant", "content": "Minerals."}], "ok", "extra")
    kept, dropped = Decontaminator(eval_texts(), whole_short=chat_eval_texts()).filter([leaked, unrelated])
    assert dropped == 1 and kept == [unrelated]


def test_labelling_stops_before_a_call_that_would_pass_the_deadline(tmp_path, target, conversations, monkeypatch):
    """No call starts that would end after the deadline, and what was labelled before it is written."""
    import foresight.training.labelling as lab

    clock = {"t": 0.0}
    monkeypatch.setattr(lab, "time", SimpleNamespace(monotonic=lambda: clock["t"]))

    def slow_encode(batch, _first):  # every call takes 10 s of the fake clock
        clock["t"] += 10.0
        return [toy_encode(c.messages) for c in batch]

    settings = LabelSettings(layers=LAYERS, topk=4, max_len=200, min_len=20, shard_tokens=10**9, batch_size=2,
                             deadline=25.0)
    data = DataDir(tmp_path, {"target_name": "tiny", "layers": LAYERS, "topk": 4})
    lab.label_stream(Labeller(target, settings), data, "text", conversations, slow_encode, max_tokens=None)
    st = data.stream("text")
    # calls at t=0 and t=10 end by 20; the next would end at 30 > 25: two calls, written before stopping
    assert st["items_done"] == 4 and len(st["shards"]) == 1 and st["sequences"] >= 1


@pytest.mark.parametrize("arch", ["llama", *HYBRID])
def test_init_from_the_targets_top_attention_layers(arch, tmp_path):
    """`--init target`: the draft layers start from the target's top softmax-attention layers (a hybrid's
    full-attention ones), computing what they compute: the same normalisation (Qwen3.5 / Qwen3-Next store
    zero-centred norm weights) and the query half of a gated attention's q_proj. A hybrid with fewer
    full-attention layers than the draft has layers is refused, naming the option."""
    from foresight.models.draft_model import DraftConfig

    target = tiny_model(arch)
    with torch.no_grad():  # norms away from their initial value, so a wrong convention shows
        for name, p in target.named_parameters():
            if "norm" in name:
                p.normal_(0.5, 0.2)
    full = [i for i, t in enumerate(getattr(target.config, "layer_types", None) or ["full_attention"] * 3)
            if t == "full_attention"]
    model = DraftModel(DraftConfig.for_target(target.config, num_layers=1), SharedWeights.from_target(target))
    report = initialise(model, target, "target")
    assert report["target_layers"] == [full[-1]] and report["tensors"] >= 8
    layer, source = model.layers[0], target.model.layers[full[-1]]
    x = torch.randn(5, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layer.input_norm(x), source.input_layernorm(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.post_norm(x), source.post_attention_layernorm(x), atol=1e-4, rtol=1e-4)
        heads, d = target.config.num_attention_heads, layer.head_dim
        query = source.self_attn.q_proj(x).view(5, heads, -1)[..., :d].reshape(5, heads * d)
        torch.testing.assert_close(layer.q_proj(x), query)
        torch.testing.assert_close(layer.k_proj(x), source.self_attn.k_proj(x))
    if arch == "qwen3_next":  # a mixture-of-experts MLP: nothing dense to copy
        assert {n.split(".")[-2] for n in report["skipped"]} == {"gate_proj", "up_proj", "down_proj"}
    if arch in HYBRID:
        two = DraftModel(DraftConfig.for_target(target.config, num_layers=2), SharedWeights.from_target(target))
        with pytest.raises(ValueError, match="--init target.*--layers 1"):
            initialise(two, target, "target")
        with pytest.raises(ValueError, match="--init target"):
            validate_init("target", target, 2)  # the CLI's check, before any labelling
    assert validate_init("target", target, 1) == "target"


def test_the_holdout_split_is_seeded_and_stays_put_when_shards_are_appended(data_dir):
    data = LabelledData(data_dir)
    held = data.holdout(0.3, seed=0)
    assert 0 < int(held.sum()) < len(data) and torch.equal(held, data.holdout(0.3, seed=0))
    assert not torch.equal(held, data.holdout(0.3, seed=1))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="holdout"):
            data.holdout(bad, seed=0)
    # A shard appended to the first stream (its sequences, under a later name) lands in the middle of the index:
    # the sequences after it move, and keep their split.
    first = [(a, n) for shard, a, n in data.index if shard == 0]
    grown = LabelledData(data_dir)
    grown.files.insert(1, data_dir / "shard-appended.safetensors")
    grown.index = ([(0, a, n) for a, n in first] + [(1, a, n) for a, n in first]
                   + [(shard + 1, a, n) for shard, a, n in data.index if shard > 0])
    again = grown.holdout(0.3, seed=0)
    assert torch.equal(torch.cat([again[:len(first)], again[2 * len(first):]]), held)


def test_held_out_sequences_are_scored_at_each_checkpoint_and_never_trained(data_dir, target, tmp_path, monkeypatch):
    import foresight.training.dataset as dataset

    data = LabelledData(data_dir)
    held = data.holdout(0.3, seed=0)
    drawn = {"train": set(), "score": set()}
    real = dataset.sample_anchors

    def recording(data, gen, n_seqs, n_anchors, block, spread, allowed=None):
        seqs, lo, anchors = real(data, gen, n_seqs, n_anchors, block, spread, allowed)
        drawn["score" if allowed is not None and torch.equal(allowed, held) else "train"].update(seqs.tolist())
        return seqs, lo, anchors

    monkeypatch.setattr(dataset, "sample_anchors", recording)
    s = dict(num_layers=1, block_size=8, context_window=32, vocab_subset=0, batch_seqs=4, anchors=2, bf16=False,
             holdout=0.3, ckpt_every=3)
    report = train(target, data, tmp_path, TrainSettings(steps=6, **s), log=lambda *_: None)
    held_ids = set(torch.nonzero(held).flatten().tolist())
    assert drawn["train"] and not drawn["train"] & held_ids and drawn["score"] <= held_ids
    assert [e["step"] for e in report["evals"]] == [0, 3, 6]  # before the first step, then at each checkpoint
    for e in report["evals"]:
        assert {"heldout", "train"} <= e.keys() and all(math.isfinite(e[k]["loss"]) for k in ("heldout", "train"))
    assert report["evals"][1]["heldout"] != report["evals"][2]["heldout"]  # the model changed between them
    resumed = train(target, data, tmp_path, TrainSettings(steps=9, **s), resume=True, log=lambda *_: None)
    assert [e["step"] for e in resumed["evals"]] == [0, 3, 6, 9]
