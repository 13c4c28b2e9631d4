"""Other users' krex daemons on this node.

Two daemons do not know each other's regions: while another user's daemon
serves on this node, its jobs may use the device a region holds here, and
that region is not clean.  A krex daemon is a listening Unix socket named
``krexd.sock``; the kernel lists every one in ``/proc/net/unix``, and the
socket file's owner is the daemon's user (a socket in a directory we may not
look into is someone else's).  :class:`Neighbours` looks now and then (the
ticker, and the end of each region) and answers which were seen during a
region.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

SOCKET_NAME = "krexd.sock"
_LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags


def listening_daemons(table: str = "/proc/net/unix") -> list[str]:
    """Paths of listening Unix sockets named ``krexd.sock``."""
    try:
        with open(table) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[-1].endswith("/" + SOCKET_NAME) \
                and int(parts[3], 16) & _LISTENING:
            out.append(parts[-1])
    return out


def owner_uid(path: str) -> int | None:
    """The socket file's owner; -1 when we may not look (not ours); None when gone."""
    try:
        return os.stat(path).st_uid
    except PermissionError:
        return -1
    except OSError:
        return None


@dataclass
class Sighting:
    path: str
    uid: int  # -1: unknown (a directory we may not enter)
    first_mono_s: float
    last_mono_s: float


class Neighbours:
    def __init__(self, own_socket: str, own_uid: int, period_s: float = 1.0,
                 scan: Callable[[], list[str]] = listening_daemons) -> None:
        self.own = os.path.realpath(own_socket)
        self.own_uid = own_uid
        self.period_s = period_s
        self.scan = scan
        self.sightings: dict[str, Sighting] = {}
        self._looked_mono_s = -1e9

    def look(self, now: float | None = None, *, fresh: bool = False) -> None:
        """Look again (at most once per period unless ``fresh``)."""
        now = time.monotonic() if now is None else now
        if not fresh and now - self._looked_mono_s < self.period_s:
            return
        self._looked_mono_s = now
        for path in self.scan():
            if os.path.realpath(path) == self.own:
                continue
            uid = owner_uid(path)
            if uid is None or uid == self.own_uid:
                continue
            seen = self.sightings.get(path)
            if seen is None or seen.uid != uid:
                self.sightings[path] = Sighting(path, uid, now, now)
            else:
                seen.last_mono_s = now
        self._forget(now)

    def during(self, start: float, end: float) -> list[Sighting]:
        """Daemons seen between ``start`` and ``end`` (a look's period of slack)."""
        self.look(end)
        slack = self.period_s * 1.5
        return [s for s in self.sightings.values()
                if s.first_mono_s <= end + slack and s.last_mono_s >= start - slack]

    def _forget(self, now: float) -> None:
        for path in [p for p, s in self.sightings.items() if now - s.last_mono_s > 600]:
            del self.sightings[path]
