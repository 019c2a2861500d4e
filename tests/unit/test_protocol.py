"""Codec: messages <-> frames, exact round trips, and the errors a peer mismatch must raise."""
from __future__ import annotations

import math
from dataclasses import FrozenInstanceError
from pathlib import Path

import msgpack
import pytest
import torch

from foresight.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, ProtocolError, decode, encode, peek_kind
from foresight.protocol.kinds import Mode, Refinement, Strategy
from foresight.protocol.messages import (
    AbortRequest,
    ControllerStats,
    DraftBlock,
    DrafterIdle,
    DrafterStatus,
    GenerateRequest,
    Heartbeat,
    HiddenLayout,
    LinearStates,
    Outcome,
    ReleaseDraft,
    RequestFailed,
    RoundStats,
    SamplingParams,
    ShardCacheCopy,
    ShardCacheFree,
    ShardCacheNew,
    ShardForward,
    ShardRollback,
    ShardVerifyBatch,
    Shutdown,
    StartDraft,
    TokenLogprobs,
    TokenOutput,
    WorkerDead,
    WorkerReady,
)

EXAMPLES = [
    SamplingParams(temperature=0.0, top_p=0.9, top_k=50, seed=7, verification="nucleus"),
    GenerateRequest(req_id="r1", prompt_ids=[1, 2, 3], max_tokens=16,
                    sampling=SamplingParams(temperature=0.7, seed=None), stop_token_ids=[2], ignore_eos=True),
    AbortRequest(req_id="r1"),
    Shutdown(reason="bye"),
    RoundStats(drafted=4, accepted=3, nucleus_extra=1, verify_s=0.0125, exposed_draft_s=None, cache_hit=True),
    TokenOutput(req_id="r1", token_ids=[5, 6], finished=True, finish_reason="stop", prompt_tokens=3,
                rounds=[RoundStats(drafted=4, accepted=2, nucleus_extra=0, verify_s=0.5, exposed_draft_s=0.001,
                                   cache_hit=None, passes=2, refreshes=1),
                        RoundStats(drafted=0, accepted=0, nucleus_extra=0, verify_s=1e-9, exposed_draft_s=None,
                                   cache_hit=False)]),
    TokenOutput(req_id="r1", token_ids=[7], logprobs=TokenLogprobs([-0.25], [[7, 8]], [[-0.25, float("-inf")]]),
                prompt_logprobs=TokenLogprobs([-1.5, -3.0], [[], []], [[], []])),
    TokenLogprobs(values=[-0.5], top_ids=[[1]], top_values=[[-0.5]]),
    RequestFailed(req_id="r2", error="OOM", status=503),
    WorkerReady(worker="target", pid=123, info={"model": "m", "layers": [1, 2], 7: None, "nested": {"a": 1.5}}),
    WorkerReady(worker="drafter", pid=124, info={"proposer": "jetspec++"},
                layout=HiddenLayout(layers=(3, 15, 27, 30), hidden_size=576, state_layers=(2,))),
    HiddenLayout(),
    WorkerDead(worker="drafter", error="RuntimeError", pid=77),
    Heartbeat(worker="target", pid=123, stalled_s=1.5),
    DrafterStatus(up=False, reason="hung: no heartbeat for 10.2 s"),
    StartDraft(req_id="r1", prompt_ids=[1], seed=3),
    Outcome(req_id="r1", round=2, accepted=1, bonus=9, max_drafts=4),
    ReleaseDraft(req_id="r1"),
    DraftBlock(req_id="r1", round=2, tokens=[], cache_hit=None, passes=2),
    DrafterIdle(req_id="r1", round=3),
    ControllerStats(auto_goodput={"greedy/ngram": 81.5, "greedy/pipelined": 60.25}, auto_exploring={"greedy": 0.01},
                    policy="lookup", load_level=4, policy_goodput={"4/lookup": 120.0, "4/plain": 110.5}),
    ControllerStats(),
    ShardCacheNew(cache=3),
    ShardCacheCopy(source=3, cache=4),
    ShardCacheFree(caches=[3, 4]),
    ShardForward(cache=3, tokens=[5, 6, 7], keep_logits=None, rollback=True),
    ShardVerifyBatch(caches=[3, 4], blocks=[[1, 2], [3]], chunk_cache=5, chunk_tokens=[8, 9]),
    ShardRollback(cache=3, rejected=2),
]


def test_examples_cover_every_kind():
    with_tensors = {LinearStates.KIND}  # test_tensor_fields_round_trip_inside_a_message
    assert {type(m).KIND for m in EXAMPLES} == set(MESSAGE_TYPES) - with_tensors


def test_tensor_fields_round_trip_inside_a_message():
    """A hybrid target's snapshot rides in an Outcome: its tensors keep dtype, shape and bits."""
    states = LinearStates(position=17, layers=[4, 5], conv=torch.randn(2, 48, 4).to(torch.bfloat16),
                          recurrent=torch.randn(2, 2, 8, 8))
    out = decode(encode(Outcome(req_id="r1", round=3, accepted=2, bonus=5, max_drafts=4,
                                hidden=torch.randn(3, 64), linear_states=states)))
    got = out.linear_states
    assert type(got) is LinearStates and (got.position, got.layers) == (17, [4, 5])
    for name in ("conv", "recurrent"):
        want = getattr(states, name)
        assert getattr(got, name).dtype == want.dtype and torch.equal(getattr(got, name), want)
    assert got.nbytes == 2 * 48 * 4 * 2 + 2 * 2 * 8 * 8 * 4


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).KIND)
def test_round_trip_is_exact(msg):
    frames = encode(msg)
    assert frames[0] == type(msg).KIND.encode()
    assert peek_kind(frames) == type(msg).KIND
    out = decode(frames)
    assert type(out) is type(msg)
    assert out == msg


def test_hidden_layout_columns_and_checks():
    layout = HiddenLayout([1, 3, 4], 2, [2])  # lists, as decoded: kept as tuples
    assert (layout.layers, layout.state_layers, layout.width) == ((1, 3, 4), (2,), 6)
    hidden = torch.arange(12.0).reshape(2, 6)  # [positions, width]
    assert layout.columns([4, 1]).tolist() == [4, 5, 0, 1] and layout.columns([]).tolist() == []
    assert torch.equal(layout.select(hidden, [3]), hidden[:, 2:4])
    forward = [torch.full((1, 2, 2), float(i)) for i in range(5)]  # hidden_states: [1, positions, hidden] per index
    assert layout.concat(forward)[0, 0].tolist() == [1, 1, 3, 3, 4, 4]
    with pytest.raises(ValueError, match="not in the layout"):
        layout.columns([2])
    for bad in (dict(layers=[3, 1], hidden_size=2), dict(layers=[1, 1], hidden_size=2),
                dict(layers=[-1], hidden_size=2), dict(state_layers=[4, 2]), dict(layers=[1])):
        with pytest.raises(ValueError):
            HiddenLayout(**bad)
    with pytest.raises(FrozenInstanceError):
        layout.hidden_size = 3


def test_nested_messages_come_back_as_dataclasses():
    req = decode(encode(EXAMPLES[1]))
    assert type(req.sampling) is SamplingParams and req.sampling.temperature == 0.7
    out = decode(encode(EXAMPLES[5]))
    assert [type(r) for r in out.rounds] == [RoundStats, RoundStats]
    assert out.rounds[0].exposed_draft_s == 0.001 and out.rounds[1].cache_hit is False


def test_scalars_keep_type_and_bits():
    weird = [0.1, -0.0, 1e308, 5e-324, math.inf, -math.inf, math.nan]
    info = {"floats": weird, "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1], "bools": [True, False],
            "none": None, "str": "héllo ✓ 世界", "empty": {}, "list": [[1, [2.5, None]], {"k": "v"}],
            "bytes": b"\x00\xff", 3: "int key"}
    out = decode(encode(WorkerReady(worker="w", pid=1, info=info))).info
    assert [math.copysign(1, x) if x == 0 else x for x in out["floats"][:6]] == \
        [0.1, -1.0, 1e308, 5e-324, math.inf, -math.inf]
    assert math.isnan(out["floats"][6])
    assert out["ints"] == info["ints"] and all(type(i) is int for i in out["ints"])
    assert out["bools"] == [True, False] and all(type(b) is bool for b in out["bools"])
    for key in ("none", "str", "empty", "list", "bytes", 3):
        assert out[key] == info[key]


def test_a_user_dict_shaped_like_a_message_stays_a_dict():
    info = {"KIND": "abort", "req_id": "x", "__kind__": "abort"}
    assert decode(encode(WorkerReady(worker="w", pid=1, info=info))).info == info


def test_frames_may_be_bytes_or_memoryviews():
    frames = encode(EXAMPLES[1])
    assert decode([bytes(f) for f in frames]) == EXAMPLES[1]
    assert decode([memoryview(f) for f in frames]) == EXAMPLES[1]


def test_unknown_kind_is_rejected():
    frames = encode(AbortRequest(req_id="x"))
    with pytest.raises(ProtocolError, match="unknown message kind 'nope'"):
        decode([b"nope", *frames[1:]])


def test_unknown_nested_kind_is_rejected():
    nested = msgpack.ExtType(1, msgpack.packb(["nope", {}]))
    body = msgpack.packb([PROTOCOL_VERSION, {"req_id": "r", "prompt_ids": [], "max_tokens": 1, "sampling": nested}])
    with pytest.raises(ProtocolError, match="unknown message kind 'nope'"):
        decode([b"generate", body])


def test_version_mismatch_is_rejected():
    body = msgpack.packb([PROTOCOL_VERSION + 1, {"req_id": "x"}])
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}.*expected {PROTOCOL_VERSION}"):
        decode([b"abort", body])


@pytest.mark.parametrize("frames", [[b"abort"], [b"abort", b""], [b"abort", b"\x92\x01\xc1"]],
                         ids=["one-frame", "empty-body", "garbage"])
def test_malformed_messages_are_rejected(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def test_field_mismatch_is_rejected():
    with pytest.raises(ProtocolError, match="abort"):
        decode([b"abort", msgpack.packb([PROTOCOL_VERSION, {"req_id": "x", "extra": 1}])])
    with pytest.raises(ProtocolError, match="abort"):
        decode([b"abort", msgpack.packb([PROTOCOL_VERSION, {}])])


def test_unencodable_values_are_rejected():
    with pytest.raises(ProtocolError, match="not a registered message"):
        encode({"req_id": "x"})
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(WorkerReady(worker="w", pid=1, info={"x": object()}))


def test_kinds_travel_as_strings_and_come_back_as_enums():
    msg = Outcome(req_id="r1", round=2, accepted=1, bonus=9, max_drafts=4, strategy="pipelined")
    assert msg.strategy is Strategy.PIPELINED
    frames = encode(msg)
    assert msgpack.unpackb(frames[1])[1]["strategy"] == "pipelined"
    assert decode(frames).strategy is Strategy.PIPELINED
    req = decode(encode(GenerateRequest(req_id="r", prompt_ids=[1], max_tokens=2, sampling=SamplingParams(),
                                        mode="auto", refinement="refresh")))
    assert (req.mode, req.refinement) == (Mode.AUTO, Refinement.REFRESH) and type(req.mode) is Mode


def test_a_bad_kind_is_rejected_where_it_enters():
    with pytest.raises(ValueError, match="mode must be one of ar, sync, pipelined, ngram, hybrid, auto"):
        GenerateRequest(req_id="r", prompt_ids=[1], max_tokens=2, sampling=SamplingParams(), mode="fast")
    stats = RoundStats(drafted=0, accepted=0, nucleus_extra=0, verify_s=0.0, exposed_draft_s=None, cache_hit=None)
    version, fields = msgpack.unpackb(encode(stats)[1])
    with pytest.raises(ProtocolError, match="strategy must be one of"):
        decode([b"round_stats", msgpack.packb([version, {**fields, "strategy": "fast"}])])


def test_no_pickle_on_the_wire():
    root = Path(__file__).resolve().parents[2] / "foresight" / "protocol"
    for name in ("codec.py", "transport.py", "cuda_ipc.py", "sockets.py"):
        assert "pickle" not in (root / name).read_text().replace("never pickle", "")
