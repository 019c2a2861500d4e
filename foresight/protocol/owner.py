"""Which process owns a socket folder or a shared-memory segment, told by its name.

Names carry `<pid>x<pidns>`: the creating process's pid and the inode of its pid namespace. A start-up
sweep may remove a leftover only when its owner is in our pid namespace and gone. The namespace matters
because /dev/shm can be shared across containers (compose's `ipc: host`): there another container's
pids are invisible to us and would look dead.
"""
from __future__ import annotations

import os
import re

_TAG = re.compile(r"(\d+)x(\d+)")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag(pid: int | None = None) -> str:
    """`<pid>x<pidns>` for `pid` (default: this process) in this process's pid namespace."""
    return f"{os.getpid() if pid is None else pid}x{pid_namespace()}"


def parse_owner(rest: str) -> tuple[int, int] | None:
    """(pid, pidns) from a name's part after its prefix, e.g. "123x4026531836_7_ab"; None: no tag."""
    match = _TAG.match(rest)
    if match is None or rest[match.end():match.end() + 1] not in ("", "_", "-"):
        return None
    return int(match.group(1)), int(match.group(2))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def owner_gone(rest: str) -> bool:
    """True only for a name whose owner is in our pid namespace and no longer runs."""
    owner = parse_owner(rest)
    if owner is None:
        return False  # not ours to judge (an older naming, or not a Foresight name at all)
    pid, ns = owner
    return ns == pid_namespace() and pid != os.getpid() and not pid_alive(pid)
