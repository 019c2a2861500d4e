"""The ZeroMQ endpoints of one server instance, chosen by the launcher and handed to both workers."""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class WorkerAddresses:
    api_to_target: str  # api PUSH (bind) -> target PULL
    workers_to_api: str  # target and drafter PUSH -> api PULL (bind)
    target_to_drafter: str  # target PUSH (bind) -> drafter PULL
    drafter_to_target: str  # drafter PUSH (bind) -> target PULL

    @classmethod
    def fresh(cls, directory: str | None = None) -> "WorkerAddresses":
        """ipc:// endpoints in a new private temporary folder (sockets live only on this host)."""
        root = Path(directory or tempfile.mkdtemp(prefix="foresight-zmq-"))
        return cls(**{f.name: f"ipc://{root / f.name}" for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerAddresses":
        return cls(**data)
