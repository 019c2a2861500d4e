"""Removing what dead instances left behind: ipc socket folders in the temp folder and shared-memory
segments in /dev/shm.

A clean stop removes its own; a crash (SIGKILL, OOM killer, power loss of a container) cannot, so each
start sweeps the leftovers whose owner, named in the leftover's name (owner.py), is gone. Nothing of a
live process, of another pid namespace, or named the old way (no owner tag) is touched.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .addresses import FOLDER_PREFIX
from .errors import ProtocolError
from .owner import owner_gone, owner_tag
from .transport import SHM_PREFIX, check_shm_name

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Swept:
    folders: int
    segments: int


def stale_folders(tmpdir: Path) -> list[Path]:
    return [p for p in sorted(tmpdir.glob(f"{FOLDER_PREFIX}*"))
            if p.is_dir() and not p.is_symlink() and owner_gone(p.name[len(FOLDER_PREFIX):])]


def stale_segments(shm_dir: Path) -> list[Path]:
    return [p for p in sorted(shm_dir.glob(f"{SHM_PREFIX}*"))
            if _is_segment_name(p.name) and owner_gone(p.name[len(SHM_PREFIX):])]


def sweep_stale(tmpdir: str | os.PathLike | None = None, shm_dir: str | os.PathLike = SHM_DIR) -> Swept:
    """Remove the socket folders and segments of dead owners; how many of each went."""
    folders = stale_folders(Path(tmpdir or tempfile.gettempdir()))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    segments = stale_segments(Path(shm_dir)) if Path(shm_dir).is_dir() else []
    for segment in segments:
        try:
            segment.unlink()
        except FileNotFoundError:
            pass  # another instance starting at the same moment swept it first
    return Swept(len(folders), len(segments))


def remove_own_folders(tmpdir: str | os.PathLike | None = None) -> int:
    """Remove the socket folders this process made (after a forced exit, which skips the engine's own clean-up);
    how many went."""
    folders = sorted(Path(tmpdir or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{owner_tag()}-*"))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return len(folders)


def _is_segment_name(name: str) -> bool:
    try:
        check_shm_name(name)
    except ProtocolError:
        return False
    return True
