"""Who is on the other end of a socket, and which processes it may act for.

Identity is ``SO_PEERCRED`` (pid, uid, gid) plus the process start time, so
a recycled PID is never mistaken for the process that connected.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from krex.errors import ProcessGone

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    start_time: int

    def alive(self) -> bool:
        return start_time(self.pid) == self.start_time


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid, start_time=start_time(pid) or 0)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def process_group(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[2]) if fields else None


def is_descendant(pid: int, ancestor: int) -> bool:
    """True when ``pid`` is ``ancestor`` or below it in the process tree."""
    seen = 0
    while pid and pid > 1 and seen < 4096:
        if pid == ancestor:
            return True
        nxt = parent_pid(pid)
        if nxt is None:
            return False
        pid = nxt
        seen += 1
    return pid == ancestor


def require_alive(pid: int, expected_start: int) -> None:
    if start_time(pid) != expected_start:
        raise ProcessGone(f"process {pid} is gone or its PID was reused", pid=pid)
