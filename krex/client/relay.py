"""``krex run``'s output relay: a frozen command's long writes to a pipe arrive whole.

A job is frozen whenever another job of its device holds it.  Freezing a process
that is blocked writing more than a pipe (or socket) can take ends that ``write(2)``
early with the count written so far, and a writer that does not write the rest loses
it: CPython's unbuffered streams (``python -u``, ``PYTHONUNBUFFERED=1``) do not
(docs/enforce.md, "A frozen writer's write comes back short").  A harness that reads
a command's output through a pipe (an agent's ``subprocess.run``, CI) would get it
cut short, silently.

So when our stdout or stderr is a pipe or a socket, :func:`run_job` gives the command
pipes of its own, 1 MiB where the kernel allows it, and this relay reads them at once
— it is ``krex run``'s process, never frozen — and writes everything on, the rest of
every partial write included.  A command's write then waits only when the relay has a
backlog of :data:`BACKLOG` bytes (its reader stopped reading).  A stream that is the
same file for both (``2>&1``) keeps one pipe, so its lines keep their order.  When our
reader goes away, the relay closes the command's pipe: its next write fails as it
would have.  Files and terminals are passed as they are.  When the command has ended
(and what it left in its process group was signalled), ``krex run`` waits up to 5 s for
whatever still holds its pipe, a process that left the group; what that writes later
goes nowhere (its write fails with ``EPIPE``).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import stat
import threading

from krex.workers.launcher import same_file

PIPE_SIZE = 1 << 20  # the command's pipe: what it may write at once without waiting
BACKLOG = 64 << 20  # what the relay keeps for a slow reader before it stops reading
CHUNK = 1 << 16


def _needs_relay(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class _Stream:
    """One relayed stream: the command writes ``write_end``; two threads copy what
    arrives on ``read_end`` to ``dest`` (one reads at once, one writes as fast as the
    destination takes it)."""

    def __init__(self, dest: int) -> None:
        self.dest = dest
        self.read_end, self.write_end = os.pipe()
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(self.write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._broken = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._read, name="krex-relay-read", daemon=True),
                         threading.Thread(target=self._write, name="krex-relay-write",
                                          daemon=True)]

    def start(self) -> None:
        os.close(self.write_end)  # the command holds it now
        self.write_end = -1
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.read_end, CHUNK)
            except OSError:
                data = b""
            with self._cond:
                if not data or self._broken:  # broken: the command's next write fails
                    self._eof = True
                    self._cond.notify_all()
                    os.close(self.read_end)
                    return
                self._chunks.append(data)
                self._size += len(data)
                self._cond.notify_all()
                while self._size > BACKLOG and not self._broken:
                    self._cond.wait()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._chunks and not self._eof:
                    self._cond.wait()
                if not self._chunks:
                    return
                data = self._chunks.popleft()
            try:
                _write_all(self.dest, data)
            except OSError:  # our reader is gone: so is the command's pipe (_read)
                with self._cond:
                    self._broken = True
                    self._chunks.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._size -= len(data)
                self._cond.notify_all()

    def finish(self, timeout_s: float) -> None:
        """Everything the command wrote is written on (or ``timeout_s`` has passed: a
        process outside the command's group may still hold its pipe)."""
        for t in self._threads:
            t.join(timeout_s)


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``: the rest of a partial write (a signal meanwhile), and
    a wait where someone made the destination non-blocking."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [])


class Relay:
    """The command's stdout and stderr (``popen()``), relayed where they are pipes."""

    def __init__(self) -> None:
        self.streams: dict[int, _Stream] = {}  # our fd -> its relay
        if _needs_relay(1):
            self.streams[1] = _Stream(1)
        if _needs_relay(2):
            if 1 in self.streams and same_file(1, 2):
                self.streams[2] = self.streams[1]
            else:
                self.streams[2] = _Stream(2)

    def popen(self) -> dict[str, int]:
        """``subprocess.Popen`` arguments giving the command the relay's pipes."""
        return {name: self.streams[fd].write_end
                for fd, name in ((1, "stdout"), (2, "stderr")) if fd in self.streams}

    def start(self) -> None:
        """After the command started: let it hold its ends, and relay."""
        for s in set(self.streams.values()):
            s.start()

    def close_unstarted(self) -> None:
        """The command did not start: close the pipes."""
        for s in set(self.streams.values()):
            for fd in (s.read_end, s.write_end):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def finish(self, timeout_s: float = 5.0) -> None:
        for s in set(self.streams.values()):
            s.finish(timeout_s)
