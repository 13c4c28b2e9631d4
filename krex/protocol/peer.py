"""Who is on the other end of a socket: the kernel's credentials of the peer.

``SO_PEERCRED`` gives the peer's pid, uid and gid as the kernel saw them at
``connect``; nothing in a message can claim another identity.  The daemon
pairs the pid with the process start time
(:class:`krex.enforce.process.ProcessRef`), so a recycled PID is never
mistaken for the process that connected.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)
