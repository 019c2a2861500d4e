"""CUDA tensors between processes through CUDA IPC, with every handle sent as plain msgpack values.

Why a ring of slots instead of sharing each tensor's own storage: every `_share_cuda_()` call
wraps the storage in a new ref-counted IPC record and the producer cannot free or reuse that memory
until the consumer drops its mapping, and opening an IPC handle costs a driver call. So each
sending process keeps, per GPU, a few preallocated byte buffers ("slots"), shares each buffer once,
and copies the tensor into a free slot. The receiver opens each slot once (cached), copies the
tensor out on a side stream, waits for that copy, then acknowledges by clearing the slot's byte in
a small CPU shared-memory block of flags. The sender reuses a slot only once its flag is clear.

Ordering: the sender records an interprocess CUDA event after its copy into the slot; the receiver
makes its side stream wait on that event, so neither side blocks the CPU on the producer's work.

A receiver in the sender's own process reads the slot directly (CUDA refuses to open a process's
own IPC handles). Devices are named by GPU UUID, since the two processes may see different CUDA_VISIBLE_DEVICES.
One ring serves one receiving process (the IPC ref counting assumes one consumer per handle), so a
process that sends CUDA tensors to several peers should give each socket its own TensorTransport.
"""
from __future__ import annotations

import secrets
import time
import weakref

import torch

from .errors import ProtocolError
from .owner import owner_tag
from .transport import SHM_PREFIX, _open_shm, _shm_unlink, check_shm_name

_uuid_to_index: dict[str, int] = {}
_LOCAL_RINGS: weakref.WeakValueDictionary[str, _Ring] = weakref.WeakValueDictionary()


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the GPU with that UUID."""
    if uuid not in _uuid_to_index:
        _uuid_to_index.update({gpu_uuid(i): i for i in range(torch.cuda.device_count())})
    if uuid not in _uuid_to_index:
        raise ProtocolError(f"GPU {uuid} is not visible to this process")
    return _uuid_to_index[uuid]


class _Ring:
    """The sender's slots on one GPU."""

    def __init__(self, index: int, slots: int, slot_bytes: int, wait_s: float):
        self.device = torch.device("cuda", index)
        self.uuid = gpu_uuid(index)
        self.slot_bytes, self.wait_s, self.next = slot_bytes, wait_s, 0
        self.name = f"{SHM_PREFIX}{owner_tag()}_cuda_{secrets.token_hex(4)}"
        # Untracked like the tensor segments (see transport._open_shm); sweep_shm(pid) covers a crash.
        self.flags = _open_shm(self.name, slots, create=True)  # zero-filled: all slots free
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.shared: list[list | None] = [None] * slots  # each slot's _share_cuda_() fields
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self.event_handles: list[bytes | None] = [None] * slots
        _LOCAL_RINGS[self.name] = self

    def put(self, t: torch.Tensor) -> dict:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:  # nothing to copy, but it should still arrive on the GPU
            return {"p": "cuda", "gpu": self.uuid, "z": 0}
        i = self._acquire()
        with torch.cuda.device(self.device):
            buf = self._slot(i, nbytes)
            # copy_ accepts a non-contiguous source, so no .contiguous() temporary is needed.
            buf[:nbytes].view(t.dtype).view(t.shape).copy_(t)
            self.events[i].record(torch.cuda.current_stream(self.device))
            if self.event_handles[i] is None:
                self.event_handles[i] = bytes(self.events[i].ipc_handle())
        self.flags.buf[i] = 1
        return {"p": "cuda", "gpu": self.uuid, "ring": self.name, "slot": i, "z": nbytes,
                "st": self.shared[i], "ev": self.event_handles[i]}

    def _acquire(self) -> int:
        """The next free slot, waiting (briefly sleeping) for the receiver to free one."""
        n, deadline = len(self.bufs), time.monotonic() + self.wait_s
        while True:
            for k in range(n):
                i = (self.next + k) % n
                if self.flags.buf[i] == 0:
                    self.next = (i + 1) % n
                    return i
            if time.monotonic() > deadline:
                raise ProtocolError(f"CUDA IPC ring full: no slot freed within {self.wait_s}s")
            time.sleep(0.0002)

    def _slot(self, i: int, nbytes: int) -> torch.Tensor:
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            # Grow to a power of two so a slowly growing context does not reallocate every round.
            size = max(self.slot_bytes, 1 << (nbytes - 1).bit_length())
            self.bufs[i] = buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            _, *fields = buf.untyped_storage()._share_cuda_()  # device index dropped: UUID instead
            self.shared[i] = fields
        return buf

    def release_all(self) -> None:
        """Mark every slot free (its reader is gone and will never acknowledge)."""
        for i in range(len(self.bufs)):
            self.flags.buf[i] = 0

    def close(self) -> None:
        _LOCAL_RINGS.pop(self.name, None)
        self.bufs = [None] * len(self.bufs)  # torch keeps them in limbo until receivers let go
        self.flags.close()
        _shm_unlink(self.name)


class CudaIpcSender:
    def __init__(self, slots: int, slot_bytes: int, wait_s: float):
        self.slots, self.slot_bytes, self.wait_s = slots, slot_bytes, wait_s
        self.rings: dict[int, _Ring] = {}

    def put(self, t: torch.Tensor) -> dict:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index not in self.rings:
            self.rings[index] = _Ring(index, self.slots, self.slot_bytes, self.wait_s)
        return self.rings[index].put(t)

    def release_all(self) -> None:
        for ring in self.rings.values():
            ring.release_all()

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()


class CudaIpcReceiver:
    def __init__(self):
        self.flags: dict[str, object] = {}  # ring name -> attached flags block
        self.slots: dict[tuple[str, int], tuple[list, torch.Tensor]] = {}  # -> (share fields, bytes)
        self.events: dict[bytes, torch.cuda.Event] = {}
        self.streams: dict[int, torch.cuda.Stream] = {}

    def take(self, desc: dict, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise ProtocolError("received a CUDA IPC tensor in a process without CUDA")
        index = device_index(desc["gpu"])
        device = torch.device("cuda", index)
        if desc["z"] == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        with torch.cuda.device(device):
            slot, ready = self._source(desc, index)
            side = self.streams.setdefault(index, torch.cuda.Stream(device))
            with torch.cuda.stream(side):
                side.wait_event(ready)
                out = torch.empty(shape, dtype=dtype, device=device)
                out.reshape(-1).view(torch.uint8).copy_(slot[: desc["z"]])
            side.synchronize()  # the slot may be overwritten as soon as we acknowledge
            out.record_stream(torch.cuda.current_stream(device))  # allocated on `side`, used here
        self.ack(desc["ring"], desc["slot"])
        return out

    def _source(self, desc: dict, index: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The slot's bytes and the event that says they are written."""
        local = _LOCAL_RINGS.get(desc["ring"])
        if local is not None:  # sender in this very process: CUDA cannot open its own handles
            return local.bufs[desc["slot"]], local.events[desc["slot"]]
        key, fields = (desc["ring"], desc["slot"]), desc["st"]
        cached = self.slots.get(key)
        if cached is None or cached[0] != fields:  # new slot, or the sender grew it
            self.slots.pop(key, None)  # drop the old mapping first so the sender can free it
            storage = torch.UntypedStorage._new_shared_cuda(index, *fields)
            flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
            cached = self.slots[key] = (fields, flat.set_(storage))
        handle = desc["ev"]
        if handle not in self.events:
            self.events[handle] = torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)
        return cached[1], self.events[handle]

    def ack(self, ring: str, slot: int) -> None:
        """Hand the slot back to the sender (also used to free the slot of a dropped message)."""
        if ring not in self.flags:
            check_shm_name(ring)  # the name comes from a message: never open anything but our rings
            try:
                self.flags[ring] = _open_shm(ring)
            except FileNotFoundError:
                return  # the sender closed its ring: nobody waits for this slot any more
        flags = self.flags[ring].buf
        if not isinstance(slot, int) or not 0 <= slot < len(flags):
            raise ProtocolError(f"bad CUDA IPC slot {slot!r} for ring {ring}")
        flags[slot] = 0

    def close(self) -> None:
        self.slots.clear()
        self.events.clear()
        for shm in self.flags.values():
            shm.close()
        self.flags.clear()
