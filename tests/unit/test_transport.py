"""Tensor paths (inline, zmq frames, shared memory, CUDA IPC) and the message sockets."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import zmq
import zmq.asyncio

from foresight.protocol import (
    AsyncMessageSocket,
    MessageSocket,
    ProtocolError,
    TensorTransport,
    decode,
    discard,
    encode,
    ipc_address,
    shm_segments,
    sweep_shm,
)
from foresight.protocol.messages import Outcome, RoundStats, StartDraft, TokenOutput, WorkerReady

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = {"scalar": (), "empty": (0, 3), "1d": (37,), "3d": (2, 3, 5), "noncontig": None}
# The transport for each CPU path: inline_max=0 pushes every non-empty tensor off the body.
PATHS = {"inline": TensorTransport(inline_max=1 << 30), "frame": TensorTransport(inline_max=0, large="frame"),
         "shm": TensorTransport(inline_max=0, large="shm")}


def make(dtype: torch.dtype, shape: tuple | None, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    full = shape if shape is not None else (6, 8)
    if dtype == torch.bool:
        t = torch.rand(full, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(full, generator=g) * 100).to(dtype)
        if t.numel() >= 3:  # special values must survive bit for bit
            t.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, full, generator=g, dtype=dtype)
        if t.numel() >= 2:
            t.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    if shape is None:
        t = t.t()[::2]  # transposed and strided
        assert not t.is_contiguous()
    return t.to(device)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == b.device.type
    a_bytes = a.cpu().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.cpu().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a_bytes, b_bytes)  # bit-exact, NaNs included
    if not (a.dtype.is_floating_point and a.isnan().any()):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.fixture(autouse=True)
def no_shm_leak():
    before = set(shm_segments(os.getpid()))
    yield
    assert set(shm_segments(os.getpid())) - before == set(), "leaked shared memory segments"


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair(ctx, address, transport=None, hwm=1000):
    pull = MessageSocket(ctx, zmq.PULL, address, bind=True, transport=transport, hwm=hwm)
    push = MessageSocket(ctx, zmq.PUSH, address, bind=False, transport=transport, hwm=hwm)
    return push, pull


# ---------------------------------------------------------------- CPU tensor paths


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", PATHS)
def test_cpu_paths_round_trip_bit_exact(path, dtype, shape):
    t = make(dtype, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch.frombuffer's non-writable-buffer warning
        out = decode(encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=4, hidden=t),
                            PATHS[path]), PATHS[path]).hidden
    assert_same(out, t)
    assert out.is_contiguous()
    out.add_(1) if dtype != torch.bool else out.logical_not_()  # owned and writable


@pytest.mark.parametrize("nbytes,path", [(64 * 1024, "inline"), (64 * 1024 + 4, "frame"), (0, "inline")])
def test_default_threshold_picks_the_path(nbytes, path):
    frames: list = []
    desc = TensorTransport().pack(torch.zeros(nbytes // 4, dtype=torch.float32), frames)
    assert desc["p"] == path and len(frames) == (path == "frame")


def test_large_shm_transport_picks_shm():
    desc = TensorTransport(large="shm").pack(torch.zeros(20_000, dtype=torch.float64), [])
    assert desc["p"] == "shm" and desc["n"] in shm_segments(os.getpid())
    TensorTransport().discard(desc)


def test_read_only_frames_are_copied_once_without_warning():
    t = make(torch.bfloat16, (300, 200))
    tp = PATHS["frame"]
    frames = [bytes(f) for f in encode(StartDraft(req_id="r", prompt_ids=[1], seed=0, hidden=t), tp)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode(frames, tp).hidden
    assert_same(out, t)


def test_nested_tensors_and_lists_of_tensors():
    tensors = {"a": make(torch.float16, (100, 700)), "b": [make(torch.bool, (3,)), make(torch.int64, ())]}
    for tp in PATHS.values():
        info = decode(encode(WorkerReady(worker="w", pid=1, info=tensors), tp), tp).info
        assert_same(info["a"], tensors["a"])
        assert_same(info["b"][0], tensors["b"][0])
        assert_same(info["b"][1], tensors["b"][1])


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ProtocolError, match="dtype"):
        encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1,
                       hidden=torch.zeros(2, dtype=torch.complex64)))


def test_bad_tensor_payload_is_rejected():
    tp = PATHS["frame"]
    frames = encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=torch.zeros(8)), tp)
    with pytest.raises(ProtocolError, match="bytes"):
        decode([frames[0], frames[1], b"\x00" * 31], tp)
    with pytest.raises(ProtocolError, match="missing"):
        decode(frames[:2], tp)


# ---------------------------------------------------------------- shared memory lifetime


def test_shm_segment_is_unlinked_by_the_receiver():
    tp = PATHS["shm"]
    frames = encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=torch.ones(1000)), tp)
    assert len(shm_segments(os.getpid())) == 1
    decode(frames, tp)
    assert shm_segments(os.getpid()) == []


def test_discard_and_sweep_free_unreceived_segments():
    tp = PATHS["shm"]
    msg = WorkerReady(worker="w", pid=1, info={"x": [torch.ones(100), torch.zeros(100)]})
    discard(encode(msg, tp), tp)
    assert shm_segments(os.getpid()) == []
    encode(msg, tp)
    assert sweep_shm(os.getpid()) == 2 and shm_segments(os.getpid()) == []


def test_failed_encode_and_decode_free_their_segments():
    tp = PATHS["shm"]
    with pytest.raises(ProtocolError):
        encode(WorkerReady(worker="w", pid=1, info={"a": torch.ones(100), "b": object()}), tp)
    frames = encode(WorkerReady(worker="w", pid=1, info={"a": torch.ones(100), "b": torch.ones(100)}), tp)
    with pytest.raises(ProtocolError):
        decode([b"abort", *frames[1:]], tp)  # wrong fields for the kind: tensors decoded, then freed
    assert shm_segments(os.getpid()) == []


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_sender(code: str, **fmt) -> subprocess.Popen:
    """A sender process running `code` (after the imports it needs)."""
    prelude = "import torch, zmq\nfrom foresight.protocol import MessageSocket, TensorTransport\n" \
              "from foresight.protocol.messages import Outcome\nctx = zmq.Context()\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code).format(**fmt)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_shm_from_another_process(ctx, tmp_path):
    """A real sender process: its segment outlives it, we copy it out, and nothing is left."""
    address = ipc_address(tmp_path, "x")
    pull = MessageSocket(ctx, zmq.PULL, address, bind=True)
    proc = run_sender("""
        sock = MessageSocket(ctx, zmq.PUSH, {address!r}, bind=False, transport=TensorTransport(large="shm"))
        t = torch.arange(100_000, dtype=torch.int64).reshape(100, 1000)
        sock.send(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=t))
        sock.socket.close(linger=5000)  # deliver before exiting
        ctx.term()
    """, address=address)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "leaked" not in err and "resource_tracker" not in err, err
    assert len(shm_segments(proc.pid)) == 1  # the sender is gone, the segment waits for us
    msg = pull.recv(timeout_ms=10_000)
    assert torch.equal(msg.hidden, torch.arange(100_000).reshape(100, 1000))
    assert shm_segments(proc.pid) == []


# ---------------------------------------------------------------- sockets


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scheme", ["ipc", "inproc"])
def test_messages_through_push_pull(ctx, tmp_path, scheme, path):
    address = ipc_address(tmp_path, "s") if scheme == "ipc" else f"inproc://s-{path}"
    push, pull = pair(ctx, address, PATHS[path])
    hidden = make(torch.bfloat16, (64, 1024))  # 128 KiB
    msgs = [Outcome(req_id="r", round=3, accepted=2, bonus=5, max_drafts=4, hidden=hidden),
            StartDraft(req_id="r", prompt_ids=[1, 2], seed=1, hidden=make(torch.float32, None)),
            TokenOutput(req_id="r", token_ids=[1], rounds=[RoundStats(1, 1, 0, 0.1, None, None)])]
    for m in msgs:
        push.send(m)
    got = [pull.recv(timeout_ms=5000) for _ in msgs]
    assert_same(got[0].hidden, hidden)
    assert_same(got[1].hidden, msgs[1].hidden)
    assert got[2] == msgs[2]
    assert (got[0].req_id, got[0].round, got[0].accepted) == ("r", 3, 2)
    push.close()
    pull.close()


def test_recv_timeout_nowait_and_poller(ctx):
    push, pull = pair(ctx, "inproc://poll")
    assert pull.recv(timeout_ms=10) is None
    assert pull.recv_nowait() is None
    poller = zmq.Poller()
    poller.register(pull.socket, zmq.POLLIN)
    assert poller.poll(10) == []
    push.send(TokenOutput(req_id="a", token_ids=[1]))
    assert dict(poller.poll(2000)).get(pull.socket) == zmq.POLLIN
    assert isinstance(pull.fileno(), int)
    assert pull.recv_nowait() == TokenOutput(req_id="a", token_ids=[1])
    assert pull.recv_nowait() is None


def test_reset_reopens_the_socket(ctx, tmp_path):
    """As the api does for a dead worker: its bound PUSH is reopened and the peer reconnects."""
    address = ipc_address(tmp_path, "r")
    push = MessageSocket(ctx, zmq.PUSH, address, bind=True)
    pull = MessageSocket(ctx, zmq.PULL, address, bind=False)
    push.send(TokenOutput(req_id="before", token_ids=[]))
    assert pull.recv(timeout_ms=5000).req_id == "before"
    old = push.socket
    push.reset()
    assert old.closed and not push.socket.closed
    push.send(TokenOutput(req_id="after", token_ids=[]))  # waits for the peer to reconnect
    assert pull.recv(timeout_ms=5000).req_id == "after"


def test_ipc_address(tmp_path):
    assert ipc_address(tmp_path, "a") == f"ipc://{tmp_path}/a"
    with pytest.raises(ValueError, match="too long"):
        ipc_address(tmp_path / ("d" * 120), "a")


def test_async_socket_receives_token_outputs(tmp_path):
    address = ipc_address(tmp_path, "api")
    expected = TokenOutput(req_id="r", token_ids=[4, 2], finished=True, finish_reason="length",
                           rounds=[RoundStats(3, 1, 0, 0.01, 0.002, True)])

    async def main():
        actx = zmq.asyncio.Context()
        try:
            pull = AsyncMessageSocket(actx, zmq.PULL, address, bind=True)
            push = AsyncMessageSocket(actx, zmq.PUSH, address, bind=False)
            assert await pull.recv(timeout_ms=10) is None
            await push.send(expected)
            return await asyncio.wait_for(pull.recv(), 5)
        finally:
            actx.destroy(linger=0)

    assert asyncio.run(main()) == expected
    with pytest.raises(TypeError):
        AsyncMessageSocket(zmq.Context.instance(), zmq.PULL, "inproc://x", bind=True)


# ---------------------------------------------------------------- CUDA IPC

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_tensors_round_trip(ctx, dtype):
    tx, rx = TensorTransport(cuda_slots=2, cuda_slot_bytes=1024), TensorTransport()
    push = MessageSocket(ctx, zmq.PUSH, f"inproc://cuda-{dtype}", bind=True, transport=tx)
    pull = MessageSocket(ctx, zmq.PULL, f"inproc://cuda-{dtype}", bind=False, transport=rx)
    try:
        for shape in SHAPES.values():
            for _ in range(3):  # more sends than slots: slots must be freed and reused
                t = make(dtype, shape, device="cuda")
                push.send(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=t))
                out = pull.recv(timeout_ms=5000).hidden
                assert out.is_cuda
                assert_same(out, t)
        big = make(dtype, (512, 1024), device="cuda")  # grows a 1 KiB slot
        push.send(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=big))
        assert_same(pull.recv(timeout_ms=5000).hidden, big)
    finally:
        tx.close()
        rx.close()


@needs_cuda
def test_cuda_ring_waits_for_acknowledgement():
    tx = TensorTransport(cuda_slots=1, cuda_wait_s=0.2)
    try:
        frames = encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1,
                                hidden=torch.ones(4, device="cuda")), tx)
        with pytest.raises(ProtocolError, match="ring full"):
            encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1,
                           hidden=torch.ones(4, device="cuda")), tx)
        assert torch.equal(decode(frames, TensorTransport()).hidden.cpu(), torch.ones(4))
    finally:
        tx.close()


@needs_cuda
def test_cuda_ring_of_a_lost_receiver_is_freed_and_its_flags_unlinked_on_close():
    """A receiver that died holding a slot: peer_lost() frees it (a restarted receiver finds room), and
    close() leaves no flag segment in /dev/shm."""
    tx = TensorTransport(cuda_slots=1, cuda_wait_s=0.2)
    msg = Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=torch.ones(4, device="cuda"))
    encode(msg, tx)  # never received: the slot stays taken
    with pytest.raises(ProtocolError, match="ring full"):
        encode(msg, tx)
    tx.peer_lost()
    frames = encode(msg, tx)
    assert torch.equal(decode(frames, TensorTransport()).hidden.cpu(), torch.ones(4))
    rings = [name for name in shm_segments(os.getpid()) if "_cuda_" in name]
    assert rings
    tx.close()
    assert not set(rings) & set(shm_segments(os.getpid()))


@needs_cuda
def test_cuda_host_transport_sends_cpu_tensors():
    tp = TensorTransport(cuda="host")
    t = make(torch.bfloat16, (3, 4), device="cuda")
    out = decode(encode(Outcome(req_id="r", round=1, accepted=0, bonus=1, max_drafts=1, hidden=t), tp), tp).hidden
    assert out.device.type == "cpu"
    assert_same(out, t.cpu())  # bit for bit: torch.equal is False on the planted NaN


@needs_cuda
def test_cuda_tensors_from_another_process(ctx, tmp_path):
    """Real CUDA IPC: a sender process, a 2-slot ring reused 6 times, device named by UUID."""
    data, done = ipc_address(tmp_path, "data"), ipc_address(tmp_path, "done")
    pull = MessageSocket(ctx, zmq.PULL, data, bind=True)
    push_done = MessageSocket(ctx, zmq.PUSH, done, bind=True)
    proc = run_sender("""
        sock = MessageSocket(ctx, zmq.PUSH, {data!r}, bind=False, transport=TensorTransport(cuda_slots=2))
        wait = MessageSocket(ctx, zmq.PULL, {done!r}, bind=False)
        for i in range(6):
            t = torch.arange(i, i + 3000, device="cuda").to(torch.bfloat16).reshape(30, 100)[:, ::2]
            sock.send(Outcome(req_id=str(i), round=i, accepted=0, bonus=1, max_drafts=1, hidden=t))
        wait.recv(timeout_ms=60_000)  # keep the ring alive until the receiver is done
        sock.transport.close()
    """, data=data, done=done)
    try:
        for i in range(6):
            msg = pull.recv(timeout_ms=60_000)
            assert msg is not None, proc.stderr.read() if proc.poll() is not None else "timeout"
            expected = torch.arange(i, i + 3000).to(torch.bfloat16).reshape(30, 100)[:, ::2]
            assert msg.hidden.is_cuda and torch.equal(msg.hidden.cpu(), expected)
        push_done.send(TokenOutput(req_id="done", token_ids=[]))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        pull.transport.close()


def test_cuda_slot_acknowledgement_flags():
    """The ack half of the ring is plain shared memory, so it is checked on any machine."""
    from foresight.protocol.transport import _open_shm, _shm_unlink

    name = f"foresight_{os.getpid()}_cuda_test"
    flags = _open_shm(name, 2, create=True)
    try:
        flags.buf[1] = 1
        TensorTransport().discard({"p": "cuda", "ring": name, "slot": 1, "gpu": "x", "z": 4})
        assert bytes(flags.buf[:2]) == b"\x00\x00"
    finally:
        flags.close()
        _shm_unlink(name)
    TensorTransport().discard({"p": "cuda", "ring": name, "slot": 1})  # sender gone: no error


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without CUDA")
def test_cuda_descriptor_without_cuda_is_rejected():
    with pytest.raises(ProtocolError, match="without CUDA"):
        TensorTransport().unpack({"p": "cuda", "d": "float32", "s": [2], "gpu": "GPU-x", "z": 8}, [])


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "foresight_../x", "other_1_2_abcd",
                                  "foresight_", "foresight_1/2", "foresight_1.2", 42, None, "foresight_" + "a" * 200])
def test_shm_names_from_messages_are_checked_before_any_file_access(name, tmp_path, monkeypatch):
    from foresight.protocol import transport

    touched = []
    monkeypatch.setattr(transport.os, "unlink", lambda path: touched.append(path))
    monkeypatch.setattr(transport, "_open_shm", lambda *a, **k: touched.append(a))
    with pytest.raises(ProtocolError, match="shared memory"):
        TensorTransport().unpack({"p": "shm", "d": "uint8", "s": [4], "n": name, "z": 4}, [])
    with pytest.raises(ProtocolError, match="shared memory"):
        TensorTransport().discard({"p": "shm", "n": name})
    assert touched == []


def test_own_shm_names_pass_the_check():
    from foresight.protocol.transport import check_shm_name

    assert check_shm_name(f"foresight_{os.getpid()}_3_0a1b2c3d") and check_shm_name("foresight_12_cuda_ab12")


def test_cuda_ack_checks_ring_name_and_slot():
    from foresight.protocol.transport import _open_shm, _shm_unlink

    with pytest.raises(ProtocolError):
        TensorTransport().discard({"p": "cuda", "ring": "../../dev/null", "slot": 0})
    name = f"foresight_{os.getpid()}_cuda_slotcheck"
    flags = _open_shm(name, 2, create=True)
    try:
        for slot in (-1, 2, "0"):
            with pytest.raises(ProtocolError):
                TensorTransport().discard({"p": "cuda", "ring": name, "slot": slot})
    finally:
        flags.close()
        _shm_unlink(name)
