"""The JSONL event log: one line per region or job event.

Each line carries ``mono_s`` (CLOCK_MONOTONIC seconds, comparable with the jobs'
own ``time.monotonic()``) and ``wall_s`` (Unix time) so the log can be
checked against timestamps the jobs record themselves.

The log never stops the daemon: events wait in a bounded queue (past it they
are dropped and counted), and a write that fails (disk full, I/O error)
loses those lines, counts them, logs it (at most every 10 s) and the writer
goes on.  When writing works again, an ``events_lost`` line says how many
went missing.  A line cut short by a failed write is skipped by
:func:`read_events`.

The runtime directory is a tmpfs (memory): past ``max_bytes`` the log is
rotated -- the file is renamed ``events.jsonl.1`` (replacing the one before)
and a new one begins with a ``log_rotated`` line -- so the two together stay
under about twice the budget.  Readers that follow the file by name reopen it
when it shrinks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from krex.daemon import priority

FLUSH_INTERVAL_S = 0.02
WARN_EVERY_S = 10.0
log = logging.getLogger("krex.daemon")


class EventLog:
    """Timestamps are taken in ``emit``; encoding and writing happen on a writer thread,
    off the grant path; a line reaches the file within ~20 ms.  ``writer`` replaces
    ``os.write`` on the file (tests)."""

    def __init__(self, path: str | None, max_queue: int = 10000,
                 writer: Callable[[bytes], int] | None = None,
                 max_bytes: int | None = None) -> None:
        self.path = path
        self.max_queue = max_queue
        self.max_bytes = max_bytes  # rotate past this size (None: never)
        self.rotations = 0
        self._size = 0
        self._rotating = False
        self.lost = 0  # events dropped (queue full) or not written (write errors)
        self._told = 0  # of those, counted in an events_lost line already
        self._warned_mono_s = -WARN_EVERY_S
        self._cut = False  # the last write stopped mid-line
        # a deque, not a queue.Queue: append and popleft are atomic, and an emit on the
        # grant path takes no lock and notifies nobody (the writer wakes on its period)
        self._queue: deque[dict[str, Any] | None] = deque()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._stopping = False
        if writer is None and path:
            self._open()
            writer = self._write_fd
        self._writer = writer
        if writer is not None:
            self._thread = threading.Thread(target=self._write_loop, name="krex-events",
                                            daemon=True)
            self._thread.start()

    def _open(self) -> None:
        assert self.path is not None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _write_fd(self, data: bytes) -> int:
        assert self._fd is not None
        return os.write(self._fd, data)

    def _rotate(self) -> None:
        """The file becomes ``PATH.1``; a new one begins (on the writer thread)."""
        assert self.path is not None and self._fd is not None
        try:
            os.replace(self.path, self.path + ".1")
            os.close(self._fd)
            self._open()
        except OSError as exc:
            self._warn(exc)
            return
        self.rotations += 1
        line = json.dumps({"event": "log_rotated", "previous": self.path + ".1",
                           "rotations": self.rotations, "mono_s": time.monotonic(),
                           "wall_s": time.time()}) + "\n"
        self._write([line])

    def emit(self, event: str, **fields: Any) -> None:
        if self._thread is None or self._stopping:
            return
        if len(self._queue) >= self.max_queue:
            self.lost += 1
            return
        self._queue.append({"event": event, "mono_s": time.monotonic(), "wall_s": time.time(),
                         **fields})

    def _write_loop(self) -> None:
        # Wake on a period rather than per event: a thread woken per event competes
        # with the session threads for the GIL right on the grant path.  At the daemon's
        # priority: preempted while it holds the GIL, it would hold up the session threads.
        priority.elevate()
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            lines: list[str] = []
            stop = False
            while self._queue:
                item = self._queue.popleft()
                if item is None:
                    stop = True
                    break
                lines.append(json.dumps(item, separators=(",", ":"), default=str) + "\n")
            if lines or self.lost > self._told:
                for chunk in self._chunks(lines):
                    self._write(chunk)
            if stop:
                if self._fd is not None:
                    os.close(self._fd)
                return

    def _chunks(self, lines: list[str]) -> list[list[str]]:
        """One flush's lines in pieces of at most an eighth of the budget (4 KiB or more),
        so a rotation falls within a burst, not after it."""
        if self.max_bytes is None:
            return [lines]
        cap, size = max(4096, self.max_bytes // 8), 0
        out: list[list[str]] = [[]]
        for line in lines:
            if size and size + len(line) > cap:
                out.append([])
                size = 0
            out[-1].append(line)
            size += len(line)
        return out

    def _write(self, lines: list[str]) -> None:
        assert self._writer is not None
        missing = self.lost - self._told
        head = []
        if self._cut:
            head.append("\n")  # end the line a failed write left unfinished
        if missing:
            head.append(json.dumps({"event": "events_lost", "count": missing,
                                    "mono_s": time.monotonic(), "wall_s": time.time()}) + "\n")
        data = "".join(head + lines).encode()
        done = 0
        try:
            while done < len(data):
                done += self._writer(data[done:])
        except OSError as exc:
            if done:  # part of it reached the file: maybe half a line
                self._cut = not data[:done].endswith(b"\n")
            self.lost += len(lines)
            self._warn(exc)
            return
        self._cut = False
        self._told += missing
        self._size += done
        if self.max_bytes is not None and self._fd is not None and self._size > self.max_bytes \
                and not self._rotating:
            self._rotating = True  # its own first line never rotates it again
            try:
                self._rotate()
            finally:
                self._rotating = False

    def _warn(self, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._warned_mono_s >= WARN_EVERY_S:
            self._warned_mono_s = now
            log.warning("event log %s: write failed (%s); %d events lost so far (the daemon "
                        "goes on serving)", self.path, exc, self.lost)

    def close(self) -> None:
        """Write everything queued so far, then stop the writer."""
        if self._thread is not None:
            self._stopping = True
            self._queue.append(None)
            self._thread.join(5)
            self._thread = None


def read_events(path: str) -> list[dict[str, Any]]:
    """Every event of the log (a line a failed write cut short is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out
