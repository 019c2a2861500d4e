"""Messages <-> zmq multipart frames, with msgpack (never pickle).

Frames: [kind (utf-8), body (msgpack), *tensor frames]. The kind comes first and alone so a
receiver can route or reject a message before decoding it. The body is the msgpack array
[PROTOCOL_VERSION, {field: value}]; since its first bytes are fixed for a given version, the
version is checked before anything else in the body is decoded.

Values msgpack does not know travel as msgpack extension types, so they can never be mistaken
for user data (a plain dict in `WorkerReady.info` stays a dict):
- EXT_MESSAGE: a nested message dataclass, payload msgpack [kind, {field: value}];
- EXT_TENSOR: a tensor, payload the msgpack descriptor from `TensorTransport.pack`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import msgpack
import torch

from .errors import ProtocolError
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION
from .transport import TensorTransport, default_transport

EXT_MESSAGE = 1
EXT_TENSOR = 2

# msgpack of [PROTOCOL_VERSION, ...]: the fixarray-of-2 marker, then the version.
_BODY_PREFIX = b"\x92" + msgpack.packb(PROTOCOL_VERSION)

_field_names: dict[type, tuple[str, ...]] = {}


def kind_of(msg: Any) -> str | None:
    """The KIND of a registered message instance, else None."""
    kind = getattr(type(msg), "KIND", None)
    return kind if MESSAGE_TYPES.get(kind) is type(msg) else None


def _fields(msg: Any) -> dict[str, Any]:
    cls = type(msg)
    names = _field_names.get(cls)
    if names is None:
        names = _field_names[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return {name: getattr(msg, name) for name in names}


# ---------------------------------------------------------------- encode


def encode(msg: Any, transport: TensorTransport | None = None) -> list:
    """Frames for `msg`: [kind bytes, msgpack body, *tensor payload buffers]."""
    kind = kind_of(msg)
    if kind is None:
        raise ProtocolError(f"{type(msg).__name__} is not a registered message")
    transport = transport or default_transport()
    tensor_frames: list = []
    descs: list[dict] = []

    def default(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, torch.Tensor):
            desc = transport.pack(obj, tensor_frames)
            descs.append(desc)
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(desc))
        nested = kind_of(obj)
        if nested is not None:
            return msgpack.ExtType(EXT_MESSAGE, _pack([nested, _fields(obj)], default))
        raise TypeError(f"cannot encode a {type(obj).__name__}")

    try:
        body = _pack([PROTOCOL_VERSION, _fields(msg)], default)
    except BaseException as e:
        for desc in descs:  # free the shm segments / CUDA slots of tensors already packed
            transport.discard(desc)
        if isinstance(e, (TypeError, ValueError, OverflowError)):
            raise ProtocolError(f"cannot encode {kind}: {e}") from e
        raise
    return [kind.encode(), body, *tensor_frames]


def _pack(obj: Any, default: Callable) -> bytes:
    return msgpack.packb(obj, default=default, use_bin_type=True)


# ---------------------------------------------------------------- decode


def decode(frames: list, transport: TensorTransport | None = None) -> Any:
    """The message in `frames` (bytes, memoryviews or zmq.Frame objects)."""
    transport = transport or default_transport()
    cls, body = _check(frames)
    tensor_frames = frames[2:]

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            return transport.unpack(_unpack(data), tensor_frames)
        if code == EXT_MESSAGE:
            kind, fields = _unpack(data, ext_hook)
            return _build(_class(kind), fields)
        raise ProtocolError(f"unknown msgpack extension type {code}")

    try:
        _, fields = _unpack(body, ext_hook)
        return _build(cls, fields)
    except Exception as e:  # malformed msgpack, bad tensor payload, unknown nested kind, ...
        discard(frames, transport)  # free the tensors not reached yet
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"cannot decode {cls.KIND}: {type(e).__name__}: {e}") from e


def discard(frames: list, transport: TensorTransport | None = None) -> None:
    """Free what a message's tensors hold (shm segments, CUDA slots) without decoding them.

    For a sender whose send failed, or a receiver that drops a message undecoded.
    """
    transport = transport or default_transport()
    try:
        _, body = _check(frames)
    except ProtocolError:
        return

    def ext_hook(code: int, data: bytes) -> None:
        if code == EXT_TENSOR:
            transport.discard(_unpack(data))
        elif code == EXT_MESSAGE:
            _unpack(data, ext_hook)

    try:
        _unpack(body, ext_hook)
    except Exception:
        pass  # best effort: a malformed message has nothing we could free


def peek_kind(frames: list) -> str:
    """The kind of a message without decoding its body."""
    return bytes(frames[0]).decode("utf-8", errors="replace")


def _check(frames: list) -> tuple[type, memoryview]:
    """The message class and body, after the kind and version checks."""
    if len(frames) < 2:
        raise ProtocolError(f"a message needs at least 2 frames, got {len(frames)}")
    cls = _class(peek_kind(frames))
    body = memoryview(frames[1])
    if body[: len(_BODY_PREFIX)] != _BODY_PREFIX:
        raise ProtocolError(f"{cls.KIND}: {_describe_version(body)}, expected {PROTOCOL_VERSION}")
    return cls, body


def _describe_version(body: memoryview) -> str:
    try:
        head = msgpack.unpackb(body, raw=False, strict_map_key=False)  # ext types stay inert
        return f"protocol version {head[0]!r}"
    except Exception:
        return "malformed body (no protocol version)"


def _class(kind: Any) -> type:
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return cls


def _unpack(data, ext_hook: Callable | None = None) -> Any:
    # strict_map_key=False: dict fields (WorkerReady.info) may have int keys.
    if ext_hook is None:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook)


def _build(cls: type, fields: Any) -> Any:
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.KIND}: fields are a {type(fields).__name__}, not a map")
    try:
        return cls(**fields)
    except TypeError as e:  # missing or unknown field: the peers disagree on the message
        raise ProtocolError(f"{cls.KIND}: {e}") from e
