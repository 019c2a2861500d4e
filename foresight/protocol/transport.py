"""How tensors travel beside a message: the codec asks a `TensorTransport` to turn each tensor into
a small msgpack-able descriptor (plus, for the frames path, an extra zmq frame) and back.

Paths (chosen by the sender; any receiver decodes all of them):
- "inline": tensors of at most `inline_max` bytes go as raw bytes inside the msgpack body. For
  small tensors one memcpy beats an extra frame or a shm segment.
- "frame": larger CPU tensors become an extra zmq frame, sent with copy=False. The frame aliases
  the tensor's memory until zmq has sent it, so a sender must not modify a tensor in place right
  after sending it (over inproc:// the receiver even gets that very memory).
- "shm": larger CPU tensors go through one `SharedMemory` segment each; the receiver copies out
  and unlinks it. A message that is never decoded leaves its segments behind: `sweep_shm(pid)`
  removes what a (dead) sender left.
- "cuda": CUDA tensors through CUDA IPC and a ring of preallocated slots (see `cuda_ipc`).
  With `cuda="host"` they are copied to the CPU instead and arrive as CPU tensors.
"""
from __future__ import annotations

import glob
import itertools
import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from .errors import ProtocolError
from .owner import owner_tag

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}

SHM_PREFIX = "foresight_"  # segment names: foresight_<pid>x<pidns>_<n>_<random> (owner.py)
# A name from a message becomes a path under /dev/shm: only our own names, no separators or dots.
_SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[A-Za-z0-9_]{1,100}")
_shm_counter = itertools.count()


@dataclass(eq=False)
class TensorTransport:
    """Per socket (or per process) choice of how tensors travel; see the module docstring."""

    inline_max: int = 64 * 1024  # bytes; at most this much goes inside the body
    large: str = "frame"  # "frame" | "shm": the path for larger CPU tensors
    cuda: str = "ipc"  # "ipc" | "host"
    cuda_slots: int = 4  # ring slots per GPU; one ring serves one receiving process
    cuda_slot_bytes: int = 8 << 20  # initial slot size; a slot grows for bigger tensors
    cuda_wait_s: float = 10.0  # how long a send waits for the receiver to free a slot
    _cuda_tx: Any = field(default=None, init=False, repr=False)
    _cuda_rx: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.large not in ("frame", "shm"):
            raise ValueError(f"large must be 'frame' or 'shm', not {self.large!r}")
        if self.cuda not in ("ipc", "host"):
            raise ValueError(f"cuda must be 'ipc' or 'host', not {self.cuda!r}")

    # ------------------------------------------------------------ sender side

    def pack(self, t: torch.Tensor, frames: list) -> dict:
        """Descriptor of `t`; appends to `frames` the extra frame the "frame" path needs."""
        if t.dtype not in _DTYPE_NAMES:
            raise ProtocolError(f"unsupported tensor dtype {t.dtype}")
        t = t.detach()
        desc = {"d": _DTYPE_NAMES[t.dtype], "s": list(t.shape)}
        if t.is_cuda and self.cuda == "ipc":
            return desc | self._cuda_sender().put(t)
        flat = _flat_bytes(t.cpu())
        nbytes = flat.numel()
        if nbytes <= self.inline_max or nbytes == 0:  # shm refuses empty segments
            return desc | {"p": "inline", "b": flat.numpy().tobytes()}
        if self.large == "shm":
            return desc | {"p": "shm", "n": _shm_put(flat), "z": nbytes}
        frames.append(memoryview(flat.numpy()))  # keeps the tensor alive until zmq is done
        return desc | {"p": "frame", "i": len(frames) - 1, "z": nbytes}

    def discard(self, desc: dict) -> None:
        """Undo a `pack` whose message will never be sent (frees its shm segment / CUDA slot)."""
        if desc.get("p") == "shm":
            _shm_unlink(desc["n"])
        elif desc.get("p") == "cuda" and "slot" in desc:
            self._cuda_receiver().ack(desc["ring"], desc["slot"])  # either side may free a slot

    # ------------------------------------------------------------ receiver side

    def unpack(self, desc: dict, frames: list) -> torch.Tensor:
        """The tensor a descriptor stands for; `frames` are the message's tensor frames."""
        try:
            dtype, shape, path = DTYPES[desc["d"]], tuple(desc["s"]), desc["p"]
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad tensor descriptor {desc!r}") from e
        if path == "inline":
            return _from_buffer(desc["b"], dtype, shape)
        if path == "frame":
            i = desc["i"]
            if not 0 <= i < len(frames):
                raise ProtocolError(f"tensor frame {i} missing ({len(frames)} tensor frames)")
            return _from_buffer(frames[i], dtype, shape, desc["z"])
        if path == "shm":
            return _shm_take(desc["n"], desc["z"]).view(dtype).reshape(shape)
        if path == "cuda":
            return self._cuda_receiver().take(desc, dtype, shape)
        raise ProtocolError(f"unknown tensor path {path!r}")

    # ------------------------------------------------------------ lifetime

    def peer_lost(self) -> None:
        """The receiving process died: nobody will acknowledge the CUDA slots it held, so free them all
        (its successor must find a ring with free slots, not wait for a dead reader)."""
        if self._cuda_tx is not None:
            self._cuda_tx.release_all()

    def close(self) -> None:
        """Free the CUDA ring(s) and unlink their flag segments; shm segments already sent stay for their
        receiver."""
        for side in (self._cuda_tx, self._cuda_rx):
            if side is not None:
                side.close()
        self._cuda_tx = self._cuda_rx = None

    def _cuda_sender(self):
        if self._cuda_tx is None:
            from .cuda_ipc import CudaIpcSender  # imported lazily: CPU-only processes never need it

            self._cuda_tx = CudaIpcSender(self.cuda_slots, self.cuda_slot_bytes, self.cuda_wait_s)
        return self._cuda_tx

    def _cuda_receiver(self):
        if self._cuda_rx is None:
            from .cuda_ipc import CudaIpcReceiver

            self._cuda_rx = CudaIpcReceiver()
        return self._cuda_rx


_DEFAULT = TensorTransport()


def default_transport() -> TensorTransport:
    """The process-wide transport used when a socket or call names none."""
    return _DEFAULT


# ---------------------------------------------------------------- raw bytes


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-d uint8 view of the tensor's bytes (made contiguous first).

    Going through uint8 is what lets bfloat16 and bool reach numpy/zmq, which know neither.
    reshape(-1) first so 0-d tensors can change element size too.
    """
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_buffer(buf, dtype: torch.dtype, shape: tuple, nbytes: int | None = None) -> torch.Tensor:
    """A tensor over `buf` without copying when possible.

    torch.frombuffer warns on read-only buffers (bytes, an unpacked msgpack bin) because in-place
    writes would then be undefined; we copy those once into a bytearray so the tensor owns
    writable memory. zmq frames received with copy=False are writable and are used in place; the
    tensor keeps the frame alive. Data that is not aligned to the element size is copied too.
    """
    mv = memoryview(buf).cast("B")
    if nbytes is not None and mv.nbytes != nbytes:
        raise ProtocolError(f"tensor payload is {mv.nbytes} bytes, descriptor says {nbytes}")
    expected = dtype.itemsize * _numel(shape)
    if mv.nbytes != expected:
        raise ProtocolError(f"{mv.nbytes} bytes cannot hold a {dtype} tensor of shape {shape}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    flat = torch.frombuffer(mv, dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- shared memory


def _open_shm(name: str, size: int = 0, create: bool = False) -> SharedMemory:
    """A segment the resource tracker does not watch: the receiver, not the sender's exit,
    decides when it goes (otherwise the sender's tracker would unlink it, with a warning)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, create=create, size=size, track=False)
    shm = SharedMemory(name=name, create=create, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (no public API < 3.13)
    return shm


def _shm_put(flat: torch.Tensor) -> str:
    name = f"{SHM_PREFIX}{owner_tag()}_{next(_shm_counter)}_{secrets.token_hex(4)}"
    shm = _open_shm(name, flat.numel(), create=True)
    try:
        shm.buf[: flat.numel()] = flat.numpy()
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return name


def check_shm_name(name) -> str:
    """`name` if it is one this transport could have made; ProtocolError otherwise (before any open or
    unlink: a peer's message must not name an arbitrary file)."""
    if not isinstance(name, str) or _SHM_NAME.fullmatch(name) is None:
        raise ProtocolError(f"bad shared memory segment name {name!r}")
    return name


def _shm_take(name: str, nbytes: int) -> torch.Tensor:
    """Copy the segment out into an owned uint8 tensor and unlink it."""
    check_shm_name(name)
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ProtocolError(f"bad shared memory size {nbytes!r}")
    try:
        shm = _open_shm(name)
    except FileNotFoundError as e:
        raise ProtocolError(f"shared memory segment {name} is gone") from e
    try:
        if shm.size < nbytes:
            raise ProtocolError(f"shared memory segment {name} holds {shm.size} < {nbytes} bytes")
        return _copy_out(shm.buf, nbytes)
    finally:
        shm.close()
        _shm_unlink(name)


def _copy_out(buf: memoryview, nbytes: int) -> torch.Tensor:
    # In its own function so the view over shm.buf is gone before shm.close() (BufferError).
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).clone()


def _shm_unlink(name: str) -> None:
    check_shm_name(name)
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def shm_segments(pid: int | None = None) -> list[str]:
    """Names of the segments a process (default: any) created and no receiver took yet."""
    pattern = f"{SHM_PREFIX}{'' if pid is None else f'{pid}x'}*"
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join("/dev/shm", pattern)))


def sweep_shm(pid: int) -> int:
    """Unlink what a (dead or finished) sender left behind; returns how many segments."""
    names = shm_segments(pid)
    for name in names:
        _shm_unlink(name)
    return len(names)
