"""The one exception type of the protocol layer, in its own module so codec, transport and
cuda_ipc can all raise it without importing each other."""
from __future__ import annotations


class ProtocolError(Exception):
    """A message could not be encoded, decoded or its tensors moved (bad kind, version, payload)."""
