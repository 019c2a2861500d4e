"""Messages between the api, target and drafter processes, and how they travel over ZeroMQ."""
from .codec import decode, discard, encode, peek_kind
from .errors import ProtocolError
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION
from .sockets import AsyncMessageSocket, MessageSocket, ipc_address, make_socket
from .transport import TensorTransport, default_transport, shm_segments, sweep_shm

__all__ = [
    "AsyncMessageSocket",
    "MESSAGE_TYPES",
    "MessageSocket",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "TensorTransport",
    "decode",
    "default_transport",
    "discard",
    "encode",
    "ipc_address",
    "make_socket",
    "peek_kind",
    "shm_segments",
    "sweep_shm",
]
