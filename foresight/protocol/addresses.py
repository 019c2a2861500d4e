"""The ZeroMQ endpoints of one server instance, chosen by the launcher and handed to both workers."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .owner import owner_tag

FOLDER_PREFIX = "foresight-zmq-"  # then <pid>x<pidns>- (see owner.py) and mkdtemp's random part


@dataclass(slots=True, frozen=True)
class WorkerAddresses:
    api_to_target: str  # api PUSH (bind) -> target PULL
    workers_to_api: str  # target and drafter PUSH -> api PULL (bind)
    target_to_drafter: str  # target PUSH -> drafter PULL (bind)
    drafter_to_target: str  # drafter PUSH (bind) -> target PULL

    @classmethod
    def fresh(cls, directory: str | None = None) -> "WorkerAddresses":
        """ipc:// endpoints in a new private temporary folder (sockets live only on this host). The
        folder's name says which process made it, so a later start can sweep it if that process died."""
        root = Path(directory or tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{owner_tag()}-"))
        return cls(**{f.name: f"ipc://{root / f.name}" for f in dataclasses.fields(cls)})

    @property
    def directory(self) -> Path:
        """The folder holding the ipc sockets."""
        return Path(self.api_to_target.removeprefix("ipc://")).parent

    def remove(self) -> None:
        """Delete the socket folder (once every socket in it is closed)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerAddresses":
        return cls(**data)
