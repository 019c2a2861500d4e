"""ZeroMQ sockets that send and receive messages (see `codec`), sync for the workers and asyncio
for the api process.

Every socket gets linger=0: a process that stops must not hang on undeliverable messages (a dead
peer's queue is dropped; the supervisor restarts peers). Tensor frames are sent with copy=False
and received as zmq.Frame objects, so large payloads are never copied by Python.
"""
from __future__ import annotations

import os
import time
from typing import Any

import zmq
import zmq.asyncio

from .codec import decode, discard, encode
from .transport import TensorTransport, default_transport

# Messages queued per peer before send blocks. Generous: the messages are small, and a worker
# blocked on a full queue is worse than a few MB of memory.
DEFAULT_HWM = 10_000
_MAX_IPC_PATH = 107  # sun_path limit of Linux unix-domain sockets, minus the final NUL


def ipc_address(tmpdir: str | os.PathLike, name: str) -> str:
    """ "ipc://<tmpdir>/<name>", refusing paths too long for a unix-domain socket."""
    path = os.path.join(os.fspath(tmpdir), name)
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(f"ipc path too long for a unix socket ({len(path)} > {_MAX_IPC_PATH}): {path}")
    return f"ipc://{path}"


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, *, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    """A socket of `kind` (zmq.PUSH, zmq.PULL, ...) bound or connected to `address`."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    try:
        _bind_or_connect(sock, address, bind)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _bind_or_connect(sock: zmq.Socket, address: str, bind: bool, tries: int = 20) -> None:
    if not bind:
        sock.connect(address)
        return
    for attempt in range(tries):
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            # A tcp port closed a moment ago (reset()) can still be held by zmq's io thread.
            if e.errno != zmq.EADDRINUSE or attempt == tries - 1:
                raise
            time.sleep(0.05)


class _MessageSocketBase:
    def __init__(self, ctx: zmq.Context, kind: int, address: str, *, bind: bool,
                 transport: TensorTransport | None = None, hwm: int = DEFAULT_HWM):
        self.ctx, self.kind, self.address, self.bind, self.hwm = ctx, kind, address, bind, hwm
        self.transport = transport or default_transport()
        self.socket = make_socket(ctx, kind, address, bind, hwm=hwm)

    def fileno(self) -> int:
        """zmq's edge-triggered notification fd (for selectors); zmq.Poller wants `.socket`."""
        return self.socket.getsockopt(zmq.FD)

    def reset(self) -> None:
        """Drop everything queued on this socket: close it and open a fresh one in its place.

        Messages already on their way to a peer are lost too; peers reconnect on their own.
        """
        self.socket.close(linger=0)
        self.socket = make_socket(self.ctx, self.kind, self.address, self.bind, hwm=self.hwm)

    def close(self) -> None:
        self.socket.close(linger=0)

    def _encode(self, msg: Any) -> list:
        return encode(msg, self.transport)

    def _decode(self, frames: list) -> Any:
        return decode(frames, self.transport)

    def _discard(self, frames: list) -> None:
        discard(frames, self.transport)


class MessageSocket(_MessageSocketBase):
    """Blocking message socket for the worker processes."""

    def send(self, msg: Any, block: bool = True) -> bool:
        """Send `msg`. With block=False, give up at once when no peer can take it (none connected, or
        every peer's queue full) and return False: a worker must never stall on a dead or hung peer."""
        frames = self._encode(msg)
        try:
            self.socket.send_multipart(frames, 0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._discard(frames)
            return False
        except BaseException:
            self._discard(frames)  # never sent: free its shm segments / CUDA slots
            raise
        return True

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next message; None if none came within `timeout_ms` (None: wait forever)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decode(self.socket.recv_multipart(copy=False))

    def recv_nowait(self) -> Any | None:
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decode(frames)


class AsyncMessageSocket(_MessageSocketBase):
    """asyncio message socket for the api process; `ctx` must be a zmq.asyncio.Context."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, address: str, **kwargs):
        if not isinstance(ctx, zmq.asyncio.Context):
            raise TypeError("AsyncMessageSocket needs a zmq.asyncio.Context")
        super().__init__(ctx, kind, address, **kwargs)

    async def send(self, msg: Any) -> None:
        frames = self._encode(msg)
        try:
            await self.socket.send_multipart(frames, copy=False)
        except BaseException:
            self._discard(frames)
            raise

    async def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next message; None if none came within `timeout_ms` (None: wait forever)."""
        if timeout_ms is not None and not await self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decode(await self.socket.recv_multipart(copy=False))
